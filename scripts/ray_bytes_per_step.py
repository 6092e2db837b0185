import time, torch
from impala.config import Config
from impala.ray_pool import RemoteActor
from impala.training import probe_env
from impala.seeding import first_life
for T in (32, 80):
    c = Config(env="PongNoFrameskip-v4", envs_per_actor=8, unroll_length=T)
    shape, dtype, n = probe_env(c)
    a = RemoteActor(0, c, shape, dtype, n, first_life(0, 0, 8))
    try:
        a.unrolls(-1, [None])
        r = a.unrolls(-1, [None])
    finally:
        a.stop()
    f = r["fields"]
    total = sum(v.nbytes for v in f.values())
    steps = 8 * T
    print(f"T={T}: object {total/2**20:.2f} MiB for {steps} agent steps: {total/steps:.0f} B/step; obs {f['obs'].nbytes/steps:.0f} B/step; "
          f"one frame {f['obs'][:, :, -1].nbytes/steps:.0f} B/step; other fields {(total-f['obs'].nbytes)/steps:.0f} B/step; pack {1000*r['pack_s']:.1f} ms")
