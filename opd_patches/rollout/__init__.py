"""The rollout: the `hf` backend (actor_rollout_ref.rollout.name=hf: Hugging Face generate behind VERL's rollout
server API, hf.py) and the acceptance of vLLM's speculative decoding per step (spec_metrics.py)."""
