"""bench_offline's vLLM side, run by the vLLM environment's python (vLLM lives in its own
virtual environment, beside loom's):

    VLLM_PYTHON benchmarks/vllm_offline_worker.py JOB.json RESULT.json

JOB.json: {"model": folder, "dtype": ..., "engine": {more LLM(...) arguments},
"requests": [[input_ids, output_len], ...]}. Every request generates exactly its own output_len
tokens (greedy, EOS ignored), all in one `generate` call; only that call is timed (start-up and
a two-request warm-up are not). RESULT.json: {"vllm_version", "wall_s", "output_lens"}.

Standard library and vLLM only: loom's packages are not installed in that environment.
"""

from __future__ import annotations

import json
import sys
import time


def run(job: dict) -> dict:
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=job["model"], dtype=job["dtype"], seed=0, **job["engine"])

    def generate(requests: list) -> list:
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids, _ in requests]
        params = [SamplingParams(max_tokens=n, min_tokens=n, ignore_eos=True, temperature=0.0)
                  for _, n in requests]
        return llm.generate(prompts, params, use_tqdm=False)

    generate([[[100 + i for i in range(8)], 4], [[200 + i for i in range(12)], 4]])  # warm-up
    start = time.perf_counter()
    outs = generate(job["requests"])
    wall = time.perf_counter() - start
    return {"vllm_version": vllm.__version__, "wall_s": wall,
            "output_lens": [len(o.outputs[0].token_ids) for o in outs]}


if __name__ == "__main__":  # vLLM's engine process re-imports the main module: run only here
    job_path, result_path = sys.argv[1:3]
    with open(job_path) as f:
        result = run(json.load(f))
    with open(result_path, "w") as f:
        json.dump(result, f)
