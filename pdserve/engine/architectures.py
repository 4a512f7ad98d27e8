"""The model architectures the engine runs, in a module without torch so `pdserve up` can check a checkpoint
before it starts anything (pdserve/services/preflight.py)."""

DENSE_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
# Sparse mixture-of-experts MLPs (engine/moe.py); their experts are not sharded for tensor parallelism yet.
# GptOssForCausalLM adds attention sinks and alternating sliding-window / full layers (engine/model.py).
MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "MixtralForCausalLM", "GptOssForCausalLM")
SUPPORTED_ARCHITECTURES = DENSE_ARCHITECTURES + MOE_ARCHITECTURES
