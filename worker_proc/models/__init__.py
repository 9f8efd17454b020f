"""Model code by architecture name (config.json `architectures[0]`)."""

from worker_proc.models.llama import CausalLM

# Llama, Qwen2 and Qwen3 share one implementation; ModelConfig carries their differences.
MODEL_CLASSES = {
    "LlamaForCausalLM": CausalLM,
    "Qwen2ForCausalLM": CausalLM,
    "Qwen3ForCausalLM": CausalLM,
}
