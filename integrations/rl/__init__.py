"""RL training flows on the data plane (GRPO, PPO, async pumps) and trainer-worker glue."""
