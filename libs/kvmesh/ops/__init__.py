"""Operations policy, pure where it can be: `warming` (prefix statistics, LFU+LRU, hot-prefix replication),
`rollout` (canary schedules and checks), `planner` (forecasts and worker counts)."""
