"""The model architectures the engine runs, in a module without torch so `pdserve up` can check a checkpoint
before it starts anything (pdserve/services/preflight.py)."""

DENSE_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
# Sparse mixture-of-experts MLPs (engine/moe.py); their experts are not sharded for tensor parallelism yet.
MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "MixtralForCausalLM")
SUPPORTED_ARCHITECTURES = DENSE_ARCHITECTURES + MOE_ARCHITECTURES
