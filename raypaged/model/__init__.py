"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2, and as subclasses Qwen3 and Phi-3) with
tensor-parallel layers, and its safetensors loader.

    config = ModelConfig.from_pretrained(model_dir, max_model_len=None)
    model = load_model(model_dir, dtype=torch.bfloat16, device="cuda", load_format="auto")
    hidden = model(input_ids, positions, kv_caches, attn_metadata)   # [T, hidden]
    logits = model.compute_logits(hidden[last_rows])                 # [S, vocab], full vocab

The TP rank and group come from `parallel.init_tensor_parallel()` (tp = 1 when never called);
each rank allocates `config.num_kv_heads_per_rank(tp)` KV heads of `config.head_dim` per layer.
"""
