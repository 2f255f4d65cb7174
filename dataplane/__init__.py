"""dataplane: a pluggable data plane for distributed RL post-training."""
