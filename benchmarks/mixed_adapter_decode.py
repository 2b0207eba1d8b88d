"""Mixed-adapter decode throughput: 32 requests, each with its own rank-8 adapter on q,k,v,o.

Model: a 6-layer, 256-wide Llama with random weights, float32 on `--device` (cpu by default); vocab 4096 by default (`--vocab`: at
Llama's 32000 the lm_head is most of every step for all three paths, which compresses every ratio).
Each request: 32 prompt tokens, 32 new tokens (greedy, EOS ignored). Tokens/s of generated tokens for
  engine      the mint engine, every row with its own adapter (32 distinct slots in one batch)
  base        the same engine and batch with no adapters (every row on slot -1)
  peft        PEFT's mixed batch, `generate(adapter_names=...)` on a PeftModel holding the same 32 adapters
  hf_base     transformers' own generate on the bare model (PEFT's base-only speed, for `peft_vs_own_base`)
and the ratios `vs_base` = engine/base, `vs_peft` = engine/peft. Targets: vs_base >= 0.8, vs_peft >= 4.

    python benchmarks/mixed_adapter_decode.py [--requests 32] [--repeats 5] [--vocab 4096] [--attn sdpa|eager]
                                              [--device cpu]
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from peft import PeftModel
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import add_device, checked_device, interleaved, report, synced

from mint_core.engine.base import from_model
from mint_core.engine.engine import Engine, EngineConfig, Request
from mint_core.engine.sampling import SamplingParams
from mint_core.engine.tokenizer import byte_tokenizer
from mint_core.lora.adapter import random_adapter, save_adapter

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]


def build_model(seed: int, vocab: int, attn: str = "sdpa", **config: Any) -> LlamaForCausalLM:
    """The benchmarks' 6-layer, 256-wide Llama with random weights (`config`: more LlamaConfig fields)."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=8,
        max_position_embeddings=256,
        **config,
    )
    cfg._attn_implementation = attn
    return LlamaForCausalLM(cfg).eval()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--attn", choices=["sdpa", "eager"], default="sdpa")
    add_device(ap)
    args = ap.parse_args()
    device = checked_device(ap, args.device)
    logging.basicConfig(level=logging.WARNING)
    n = args.requests

    engine = Engine(
        from_model(build_model(0, args.vocab, args.attn).to(device), byte_tokenizer(), "bench-llama"),
        EngineConfig(max_loras=n, max_lora_rank=args.rank, target_modules=TARGETS, max_model_len=256),
    )
    tmp = Path(tempfile.mkdtemp(prefix="mint-bench-"))
    names = [f"policy{i:02d}" for i in range(n)]
    for i, name in enumerate(names):
        a = random_adapter(engine.sites, TARGETS, args.rank, seed=i, base_fingerprint=engine.base.fingerprint)
        save_adapter(a, tmp / name, engine.sites)
        engine.load_adapter(name, tmp / name)
        engine.working_set.pin(name)  # all resident: this measures decode, not loading

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (args.prompt_tokens,), generator=g).tolist() for _ in range(n)]
    params = SamplingParams(max_tokens=args.new_tokens, ignore_eos=True)
    new_tokens = n * args.new_tokens

    def run_engine(adapters: list[str | None]) -> None:
        out = engine.generate([Request(p, a, params) for p, a in zip(prompts, adapters, strict=True)])
        assert sum(len(c.token_ids) for c in out) == new_tokens

    peft_model = PeftModel.from_pretrained(
        build_model(0, args.vocab, args.attn), tmp / names[0], adapter_name=names[0]
    )
    for name in names[1:]:
        peft_model.load_adapter(tmp / name, adapter_name=name)
    peft_model.to(device).eval()
    ids = torch.tensor(prompts, device=device)

    def run_peft() -> None:
        with torch.no_grad():
            out = peft_model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                adapter_names=names,
                max_new_tokens=args.new_tokens,
                min_new_tokens=args.new_tokens,
                do_sample=False,
            )
        assert out.shape[1] - ids.shape[1] == args.new_tokens

    def run_hf_base() -> None:
        with torch.no_grad(), peft_model.disable_adapter():
            peft_model.get_base_model().generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=args.new_tokens,
                min_new_tokens=args.new_tokens,
                do_sample=False,
            )

    t = interleaved(
        {
            "engine": synced(lambda: run_engine(list(names)), device),
            "base": synced(lambda: run_engine([None] * n), device),
            "peft": synced(run_peft, device),
            "hf_base": synced(run_hf_base, device),
        },
        rounds=args.repeats,
    )

    # Same greedy tokens as PEFT for a few rows: the speed compared is of the same computation.
    check = engine.generate([Request(prompts[i], names[i], params) for i in range(4)])
    with torch.no_grad():
        ref = peft_model.generate(
            input_ids=ids[:4],
            attention_mask=torch.ones_like(ids[:4]),
            adapter_names=names[:4],
            max_new_tokens=args.new_tokens,
            min_new_tokens=args.new_tokens,
            do_sample=False,
        )[:, args.prompt_tokens :]
    agree = sum(c.token_ids == r.tolist() for c, r in zip(check, ref, strict=True))

    tps = {k: new_tokens / v for k, v in t.items()}
    print(
        f"threads={torch.get_num_threads()} requests={n} rank={args.rank} vocab={args.vocab} attn={args.attn} "
        f"prompt={args.prompt_tokens} new={args.new_tokens} rounds={args.repeats} (medians, interleaved)"
    )
    for k, v in tps.items():
        print(f"  {k:7s} {v:8.1f} tokens/s")
    print(f"  greedy outputs equal to PEFT's for {agree}/4 checked requests")
    report(
        {
            "engine_tokens_per_s": round(tps["engine"], 1),
            "base_tokens_per_s": round(tps["base"], 1),
            "peft_tokens_per_s": round(tps["peft"], 1),
            "vs_base": round(tps["engine"] / tps["base"], 3),
            "vs_peft": round(tps["engine"] / tps["peft"], 3),
            "hf_base_tokens_per_s": round(tps["hf_base"], 1),
            "peft_vs_own_base": round(tps["peft"] / tps["hf_base"], 3),
            "vocab": args.vocab,
            "peft_agree": agree,
            "device": device,
        }
    )


if __name__ == "__main__":
    main()
