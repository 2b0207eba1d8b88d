"""One GRPO step in mint vs TRL's GRPOTrainer with PEFT: same model, same batch, same run.

Model: the 6-layer, 256-wide Llama of mixed_adapter_decode.py (random weights, float32, sdpa; on `--device`, cpu
by default: on cuda both sides run on the GPU, TRL where accelerate puts it, hence cuda and not cuda:N) with the
byte tokenizer's 259-token vocabulary; both sides get their own copy built from the same seed. Policy: LoRA rank 8,
alpha 16, on q,k,v,o (no dropout). Batch: 4 prompts of the "add" task x group 8 = 32 completions of at most 8
new tokens, temperature 1, no top-k/top-p. Reward: mint_core.data.rewards `char_overlap` on both sides.

One step is the same work on both sides:
  - sample 32 completions of <= 8 tokens with the LoRA policy (mint: its engine, one batch of 32 with the
    adapter in a slot, its decode steps compiled by default, `--decode`; TRL: transformers' `generate` on the
    PeftModel, no vLLM), score them, group advantages;
  - one forward/backward of the policy over the 32 prompt + completion rows (no reference model: KL weight
    0, mint's default and TRL's `beta=0.0`; no extra "old logprobs" forward on either side, the update being
    on-policy; no KL metric either: TRL at `beta=0.0` measures none, so mint runs with `track_kl=False`,
    without its default's no-grad forward of the base over one row per group), clipped loss with eps 0.2 / 0.28 normalised over all completion tokens (mint "token_mean",
    TRL "dapo"), std-scaled group advantages. TRL runs the 32 full rows; mint runs each of the 4 distinct
    prompts once and the 32 completions after its cached keys/values (the same logprobs and gradients, see
    MultiPolicyTrainer._logprobs): that, not a smaller batch, is where its update saves work;
  - one AdamW step (lr 1e-4 constant, betas (0.9, 0.999), no weight decay, gradient norm clipped to 1).
mint runs with `drop_zero_variance=False`, because TRL has no such filter: every row enters the loss on both
sides whatever the rewards. TRL runs with gradient checkpointing off (its config defaults it on; mint does not
recompute activations), bf16/fp16 off, logging and saving off, report_to none.

Timing: the two alternate step by step in one process. A TRL callback runs one mint step right after each TRL
step ends; a TRL step is timed from its `on_step_begin` to its `on_step_end` plus the loop's own work until the
next `on_step_begin` (data loading, bookkeeping), the mint step's time taken out. The first `--warmup` steps of
each are skipped; medians over `--steps`. Threads: `--threads` (default 1). Each step is timed twice: wall
clock, and the process's CPU time, which on a shared machine does not count time spent waiting for a core
(with one thread it is the step's compute; `cpu_speedup` is the ratio of those).

mint's decode: `--decode compiled` (the default) runs the engine's compiled decode step
(`EngineConfig.compile_decode`, what a recipe's `compile_decode` turns on), which compiles during mint's first
warmup step: `mint_first_step_s` is that step, compile included, the price a run pays once. `--decode eager`
runs transformers' forward, mint's default engine.

Keys: `speedup` = TRL s/step / mint s/step, wall clock (target >= 2), `mint_step_s`, `trl_step_s`,
`cpu_speedup` and `*_step_cpu_s` the same in CPU time, and the mean
completion length of each over all steps (tokens per row, EOS included) to show both generated as much.

    python benchmarks/grpo_vs_trl.py [--steps 8] [--warmup 2] [--threads 1] [--device cpu] [--decode compiled]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaForCausalLM, PrinterCallback, TrainerCallback

sys.path.insert(0, str(Path(__file__).resolve().parent))
import mixed_adapter_decode
from _common import add_device, checked_device, report, synchronize
from mixed_adapter_decode import TARGETS

from mint_core.data.generators import split
from mint_core.data.rewards import reward
from mint_core.engine.base import from_model
from mint_core.engine.engine import Engine, EngineConfig
from mint_core.engine.tokenizer import byte_tokenizer
from mint_core.rl.grpo import GRPOConfig as MintGRPOConfig
from mint_core.rl.policy import PolicySpec
from mint_core.rl.trainer import MultiPolicyTrainer

TASK = "add"
REWARD = "char_overlap"


def build_model(seed: int, tokenizer: Any) -> LlamaForCausalLM:
    """mixed_adapter_decode.py's 6-layer 256-wide Llama, with the byte tokenizer's vocabulary and specials."""
    return mixed_adapter_decode.build_model(
        seed,
        len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=8, help="timed steps of each")
    ap.add_argument("--warmup", type=int, default=2, help="steps of each not timed")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--lr", type=float, default=MintGRPOConfig().learning_rate)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--decode", choices=["compiled", "eager"], default="compiled", help="mint's decode step (see above)"
    )
    add_device(ap)
    args = ap.parse_args()
    device = checked_device(ap, args.device)
    if device not in ("cpu", "cuda"):
        ap.error(
            f"--device {device}: TRL runs on accelerate's GPU; choose it with CUDA_VISIBLE_DEVICES and --device cuda"
        )
    logging.basicConfig(level=logging.WARNING)
    warnings.filterwarnings("ignore")
    import trl
    from datasets import Dataset
    from peft import LoraConfig
    from transformers.utils import logging as hf_logging
    from trl import GRPOConfig, GRPOTrainer

    hf_logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    tok = byte_tokenizer()
    total = args.warmup + args.steps
    examples = split(TASK, args.prompts * total, 1, 11)[0]
    by_id = {ex.id: ex for ex in examples}

    # ---- mint: one policy of the multi-policy trainer over its engine
    engine = Engine(
        from_model(build_model(0, tok).to(device), tok, "bench-llama"),
        EngineConfig(
            max_loras=1,
            max_lora_rank=8,
            target_modules=TARGETS,
            max_model_len=256,
            compile_decode=args.decode == "compiled",
        ),
    )
    mint_cfg = MintGRPOConfig(
        group_size=args.group,
        max_new_tokens=args.new_tokens,
        learning_rate=args.lr,
        drop_zero_variance=False,
        track_kl=False,
    )
    spec = PolicySpec(name="policy", task=TASK, reward=REWARD, rank=8, alpha=16, targets=TARGETS)
    mint = MultiPolicyTrainer(engine, mint_cfg, [spec], seed=0)
    mint_times: list[float] = []
    mint_cpu: list[float] = []
    mint_tokens: list[float] = []

    def mint_step(i: int) -> None:
        t0, c0 = time.perf_counter(), time.process_time()
        stats = mint.step({"policy": examples[i * args.prompts : (i + 1) * args.prompts]})
        synchronize(device)
        mint_times.append(time.perf_counter() - t0)
        mint_cpu.append(time.process_time() - c0)
        mint_tokens.append(stats.extra["policy"]["n_tokens"] / (args.prompts * args.group))

    # ---- TRL: GRPOTrainer + PEFT on its own copy of the same model
    score = reward(REWARD)

    def trl_reward(completions: list[str], example_id: list[str], **_: Any) -> list[float | None]:
        return [score(by_id[i], c) for c, i in zip(completions, example_id, strict=True)]

    dataset = Dataset.from_list([{"prompt": ex.prompt, "example_id": ex.id} for ex in examples])
    out_dir = tempfile.mkdtemp(prefix="mint-grpo-vs-trl-")
    trl_cfg = GRPOConfig(
        output_dir=out_dir,
        per_device_train_batch_size=args.prompts * args.group,
        gradient_accumulation_steps=1,
        num_generations=args.group,
        max_completion_length=args.new_tokens,
        max_steps=total,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=mint_cfg.max_grad_norm or 0.0,
        adam_beta1=mint_cfg.adam_betas[0],
        adam_beta2=mint_cfg.adam_betas[1],
        adam_epsilon=mint_cfg.adam_eps,
        beta=mint_cfg.kl_coef,
        epsilon=mint_cfg.eps_low,
        epsilon_high=mint_cfg.eps_high,
        loss_type="dapo",
        scale_rewards="group",
        temperature=mint_cfg.temperature,
        top_p=1.0,
        top_k=0,
        num_iterations=1,
        shuffle_dataset=False,
        gradient_checkpointing=False,
        use_cpu=device == "cpu",
        bf16=False,
        fp16=False,
        logging_strategy="no",
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
    )
    peft_cfg = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=TARGETS, task_type="CAUSAL_LM")

    class Interleave(TrainerCallback):
        """Times each TRL step and runs one mint step after it."""

        def __init__(self) -> None:
            self.step_s: list[float] = []
            self.gap_s: list[float] = []
            self.step_cpu: list[float] = []
            self.gap_cpu: list[float] = []
            self.begin = self.begin_cpu = 0.0
            self.after: tuple[float, float] | None = None
            self.mean_length = float("nan")

        def on_step_begin(self, *a: Any, **k: Any) -> None:
            synchronize(device)
            self.begin, self.begin_cpu = time.perf_counter(), time.process_time()
            if self.after is not None:
                self.gap_s.append(self.begin - self.after[0])
                self.gap_cpu.append(self.begin_cpu - self.after[1])

        def on_step_end(self, *a: Any, **k: Any) -> None:
            synchronize(device)
            self.step_s.append(time.perf_counter() - self.begin)
            self.step_cpu.append(time.process_time() - self.begin_cpu)
            mint_step(len(self.step_s) - 1)
            self.after = (time.perf_counter(), time.process_time())

        def on_log(self, *a: Any, logs: dict[str, float] | None = None, **k: Any) -> None:
            # with logging off, the one log at the end averages the metrics over every step
            if logs and "completions/mean_length" in logs:
                self.mean_length = float(logs["completions/mean_length"])

    clock = Interleave()
    trainer = GRPOTrainer(
        model=build_model(0, tok),
        reward_funcs=trl_reward,
        args=trl_cfg,
        train_dataset=dataset,
        processing_class=tok,
        peft_config=peft_cfg,
        callbacks=[clock],
    )
    trainer.remove_callback(PrinterCallback)  # its end-of-training summary would print over our report
    torch.set_num_threads(args.threads)
    trainer.train()

    # a TRL step: begin -> end, plus the loop's work before the next begin (the last step has none after it)
    trl_full = [s + g for s, g in zip(clock.step_s, clock.gap_s, strict=False)]
    trl_full_cpu = [s + g for s, g in zip(clock.step_cpu, clock.gap_cpu, strict=False)]
    trl_s = statistics.median(trl_full[args.warmup :])
    mint_s = statistics.median(mint_times[args.warmup :])
    trl_cpu = statistics.median(trl_full_cpu[args.warmup :])
    mint_cpu_s = statistics.median(mint_cpu[args.warmup :])
    mint_len = statistics.mean(mint_tokens)
    trl_len = clock.mean_length
    print(
        f"threads={torch.get_num_threads()} trl={trl.__version__} batch {args.prompts}x{args.group}, "
        f"<= {args.new_tokens} new tokens, {args.steps} timed steps after {args.warmup} (medians, interleaved)"
    )
    print(f"  mint {mint_s:7.3f} s/step ({mint_cpu_s:.3f} CPU s)   {[round(t, 3) for t in mint_times]}")
    print(f"  trl  {trl_s:7.3f} s/step ({trl_cpu:.3f} CPU s)   {[round(t, 3) for t in trl_full]}")
    print(f"  mean completion tokens per row: mint {mint_len:.2f}, trl {trl_len:.2f}")
    print(f"  mint decode {args.decode}; its first step (compile included) {mint_times[0]:.1f} s")
    report(
        {
            "speedup": round(trl_s / mint_s, 3),
            "mint_step_s": round(mint_s, 4),
            "trl_step_s": round(trl_s, 4),
            "cpu_speedup": round(trl_cpu / mint_cpu_s, 3),
            "mint_step_cpu_s": round(mint_cpu_s, 4),
            "trl_step_cpu_s": round(trl_cpu, 4),
            "trl_loop_overhead_s": round(statistics.median(clock.gap_s[args.warmup :] or [0.0]), 4),
            "mint_mean_completion_tokens": round(mint_len, 3),
            "trl_mean_completion_tokens": round(trl_len, 3),
            "mint_decode": args.decode,
            "mint_first_step_s": round(mint_times[0], 2),
            "threads": torch.get_num_threads(),
            "steps": args.steps,
            "trl_version": trl.__version__,
            "device": device,
        }
    )


if __name__ == "__main__":
    main()
