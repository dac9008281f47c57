"""Version rollouts: canary analysis and the step schedule (pure)."""
