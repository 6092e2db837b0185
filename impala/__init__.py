"""IMPALA / V-trace actor-critic trainer."""
