"""The model architectures the engine runs, in a module without torch so `pdserve up` can check a checkpoint
before it starts anything (pdserve/services/preflight.py)."""

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
