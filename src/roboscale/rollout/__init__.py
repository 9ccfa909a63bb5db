"""The rollout engine: env workers that step simulators, inference servers that batch the policy's calls across
them, and the scheduling (episode seeds, retries, resume) that evaluation and RL post-training share."""
