"""The `hf` rollout (actor_rollout_ref.rollout.name=hf): Hugging Face generate behind VERL's rollout server API."""
