#!/usr/bin/env bash
# Two real hosts on one machine: a learner host and an actor host, each a network namespace with its own
# address, joined by a veth pair. A Ray head runs on the learner host, a Ray worker node on the actor host,
# and a short CartPole run (`run.py --ray HEAD --num_actors 0`) must finish with every remote actor acting
# on the actor host, its traffic crossing the veth pair.
#
#   bash scripts/ray_two_hosts.sh
#
# Needs root, `ip netns` and Ray (pip install -r requirements-ray.txt); where one is missing it prints why
# and exits 0 (a skip). Token authentication is on, as on a real cluster: one random token for both nodes.
# Everything it starts lives in its two namespaces and is killed with them at the end (never `ray stop`,
# which would stop every Ray of the machine).
#
# Environment:
#   PYTHON               interpreter with impala's requirements and Ray (default: python3)
#   RAY_TWO_HOSTS_STEPS  agent steps of the run (default 3000)
#   RAY_TWO_HOSTS_NET    the first three octets of the hosts' /24 (default 10.213.77)
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
STEPS=${RAY_TWO_HOSTS_STEPS:-3000}
NET=${RAY_TWO_HOSTS_NET:-10.213.77}
LEARNER_IP=$NET.1
ACTOR_IP=$NET.2
PORT=6390
NS_L=impala-learner-$$
NS_A=impala-actors-$$
WORK=$(mktemp -d /tmp/impala-two-hosts.XXXXXX)

skip() { echo "ray_two_hosts: skipped: $*"; exit 0; }
[ "$(id -u)" = 0 ] || skip "needs root for network namespaces (uid $(id -u))"
command -v ip >/dev/null || skip "no ip command (iproute2)"
"$PYTHON" -c "import ray" 2>/dev/null || skip "Ray is not installed (pip install -r requirements-ray.txt)"
ip netns add "$NS_L" 2>/dev/null || skip "ip netns add failed (no network namespaces here)"

cleanup() {
    for ns in "$NS_L" "$NS_A"; do
        pids=$(ip netns pids "$ns" 2>/dev/null || true)
        [ -n "$pids" ] && kill -TERM $pids 2>/dev/null || true
    done
    sleep 2
    for ns in "$NS_L" "$NS_A"; do
        pids=$(ip netns pids "$ns" 2>/dev/null || true)
        [ -n "$pids" ] && kill -KILL $pids 2>/dev/null || true
        ip netns del "$ns" 2>/dev/null || true
    done
    rm -rf "$WORK"
}
trap cleanup EXIT

# Two hosts and a cable between them.
ip netns add "$NS_A"
ip link add "vl$$" type veth peer name "va$$"
ip link set "vl$$" netns "$NS_L"
ip link set "va$$" netns "$NS_A"
ip -n "$NS_L" addr add "$LEARNER_IP/24" dev "vl$$"
ip -n "$NS_A" addr add "$ACTOR_IP/24" dev "va$$"
for ns in "$NS_L" "$NS_A"; do ip -n "$ns" link set lo up; done
ip -n "$NS_L" link set "vl$$" up
ip -n "$NS_A" link set "va$$" up

export RAY_AUTH_MODE=token RAY_USAGE_STATS_ENABLED=0
RAY_AUTH_TOKEN=$("$PYTHON" -c "import secrets; print(secrets.token_hex(16))")
export RAY_AUTH_TOKEN
RAY="$PYTHON -m ray.scripts.scripts"
common=(--object-store-memory=300000000 --disable-usage-stats)
echo "ray_two_hosts: head on $LEARNER_IP ($NS_L), worker on $ACTOR_IP ($NS_A)"
ip netns exec "$NS_L" $RAY start --head --node-ip-address="$LEARNER_IP" --port=$PORT --num-cpus=1 "${common[@]}" \
    --include-dashboard=false --temp-dir="$WORK/ray" >"$WORK/head.log" 2>&1 \
    || { cat "$WORK/head.log"; exit 1; }
ip netns exec "$NS_A" $RAY start --address="$LEARNER_IP:$PORT" --node-ip-address="$ACTOR_IP" --num-cpus=2 "${common[@]}" \
    --resources='{"actor_slot": 2}' >"$WORK/worker.log" 2>&1 \
    || { cat "$WORK/worker.log"; exit 1; }

# The learner on the head's host; its remote actors need actor_slot, which only the actor host has.
status=0
ip netns exec "$NS_L" timeout 600 "$PYTHON" run.py --env CartPole-v1 --ray "$LEARNER_IP:$PORT" --num_actors 0 \
    --ray_actors 2 --ray_envs_per_actor 4 --ray_actor_resource actor_slot --unroll_length 5 --batch_size 8 \
    --num_learner_threads 1 --total_steps "$STEPS" --log_interval_s 2 --savedir "$WORK/runs" --xpid two-hosts \
    >"$WORK/run.log" 2>&1 || status=$?
acting=$(grep -o "Remote actor [0-9]* acting (pid [0-9]* on [0-9.]*" "$WORK/run.log" || true)
echo "$acting" | sed 's/^/ray_two_hosts: /'
if [ "$status" != 0 ] || ! grep -q "Run ended (finished) at step $STEPS" "$WORK/run.log"; then
    tail -40 "$WORK/run.log"
    echo "ray_two_hosts: FAILED: the run did not finish (exit $status)"
    exit 1
fi
if [ "$(echo "$acting" | grep -c " on $ACTOR_IP$")" -lt 2 ] || echo "$acting" | grep -qv " on $ACTOR_IP$"; then
    echo "ray_two_hosts: FAILED: every remote actor must act on the actor host $ACTOR_IP"
    exit 1
fi
echo "ray_two_hosts: ok: $STEPS steps learned from 2 remote actors on $ACTOR_IP, head on $LEARNER_IP"
