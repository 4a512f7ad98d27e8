"""The model architectures the engine runs, in a module without torch so `pdserve up` can check a checkpoint
before it starts anything (pdserve/services/preflight.py)."""

# Phi3ForCausalLM: Llama's layer with q/k/v and gate/up fused in the checkpoint (split at load).
DENSE_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                       "Phi3ForCausalLM")
# Sparse mixture-of-experts MLPs (engine/moe.py); with tensor parallelism only by expert parallelism (whole experts).
# GptOssForCausalLM adds attention sinks and alternating sliding-window / full layers (engine/model.py).
# DeepseekV3ForCausalLM: multi-head latent attention (engine/mla.py; the pool holds one latent per token), shared
# experts and the grouped top-k router.
MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "MixtralForCausalLM", "GptOssForCausalLM", "DeepseekV3ForCausalLM")
SUPPORTED_ARCHITECTURES = DENSE_ARCHITECTURES + MOE_ARCHITECTURES
