"""`hetero-sd train-head`: train an EAGLE-3 head for the configured target, on this machine.

    train_head(load_config("configs/cpu.yaml"), Path("heads/smollm2"), TrainOptions(minutes=20))

Stages, each saved under `out/` so an interrupted run resumes where it stopped:
  1. data/sequences.json   self-distilled responses + standard-library text (token ids)
  2. data/examples.npz     one target pass per sequence: features and draft-vocabulary logits
  3. checkpoint.pt         head + optimizer every `save_every` steps (--resume continues)
  4. config.json, model.safetensors   the head in EAGLE-3's layout (what `drafter.head` reads)
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from hetero_sd.ir.eagle import EagleHead, HeadConfig
from hetero_sd.training import data as D
from hetero_sd.training.options import TrainOptions
from hetero_sd.training.ttt import ttt_loss


def _log(msg: str) -> None:
    import sys
    print(f"[train-head] {msg}", file=sys.stderr, flush=True)


def _bar(total: int, desc: str):
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, leave=False)


def make_sequences(engine, opts: TrainOptions, path: Path) -> list[list[int]]:
    """Prompt + the target's greedy response, for every prompt; standard-library chunks."""
    seqs = json.loads(path.read_text()) if path.exists() else []
    prompts = D.instruction_prompts()
    prompts = (prompts + D.grounded_prompts(max(0, opts.prompts - len(prompts)), opts.seed))[:opts.prompts]
    done = sum(1 for s in seqs if s.get("kind") == "response")
    with _bar(len(prompts), "self-distillation") as bar:
        bar.update(done)
        for prompt in prompts[done:]:
            ids = engine.encode(prompt)[-opts.seq_len // 2:]
            out = engine.generate_ids(ids, opts.max_new_tokens, target_only=True)
            seqs.append({"kind": "response", "ids": ids + out.token_ids})
            path.write_text(json.dumps(seqs))  # after each: an interrupted run keeps what it made
            bar.update(1)
    if not any(s.get("kind") == "source" for s in seqs):
        tok = engine.tokenizer
        chunks = D.source_chunks(lambda t: tok.encode(t, add_special_tokens=False), opts.source_chunks,
                                 opts.seq_len, opts.seed)
        seqs += [{"kind": "source", "ids": c} for c in chunks]
        path.write_text(json.dumps(seqs))
    return [s["ids"][:opts.seq_len] for s in seqs]


def make_examples(runner, seqs: list[list[int]], draft_ids: np.ndarray, path: Path) -> list[D.Example]:
    if path.exists():
        z = np.load(path)
        return [D.Example(z[f"t{i}"], z[f"f{i}"], z[f"l{i}"]) for i in range(int(z["n"]))]
    with _bar(len(seqs), "target pass") as bar:
        examples = D.target_pass(runner, seqs, draft_ids, progress=lambda i: bar.update(1))
    arrays = {"n": np.array(len(examples))}
    for i, ex in enumerate(examples):
        arrays.update({f"t{i}": ex.tokens, f"f{i}": ex.features, f"l{i}": ex.labels})
    np.savez(path, **arrays)
    return examples


def init_head(cfg: HeadConfig, target_ir, draft_ids: np.ndarray, seed: int) -> EagleHead:
    """Random layer (seeded); LM head and final norm from the target's, restricted to the draft vocabulary."""
    torch.manual_seed(seed)
    w = target_ir.weights
    embed = w.get("model.embed_tokens.weight").float()
    head = EagleHead(cfg, embed)
    head.set_vocab(torch.as_tensor(draft_ids))
    lm = embed if target_ir.config.tie_word_embeddings else w.get("lm_head.weight").float()
    with torch.no_grad():
        head.lm_head.weight.copy_(lm[torch.as_tensor(draft_ids)])
        head.norm.copy_(w.get("model.norm.weight").float())
        for lin in (head.q_proj, head.k_proj, head.v_proj, head.o_proj, head.gate_proj, head.up_proj,
                    head.down_proj, head.fc):
            lin.weight.mul_(0.5)
    return head


def _batches(examples: list[D.Example], batch: int, rng: np.random.Generator):
    """Random batches of equal-length sequences (cut to the shortest in the batch)."""
    while True:
        pick = [examples[i] for i in rng.permutation(len(examples))[:batch]]
        T = min(len(e.tokens) for e in pick)
        yield (torch.as_tensor(np.stack([e.tokens[:T] for e in pick])),
               torch.as_tensor(np.stack([e.features[:T] for e in pick]).astype(np.float32)),
               torch.as_tensor(np.stack([e.labels[:T] for e in pick]).astype(np.float32)))


def train(head: EagleHead, examples: list[D.Example], opts: TrainOptions, out: Path, resume: bool) -> dict:
    head.lm_head.weight.requires_grad_(opts.train_lm_head)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=opts.lr, weight_decay=0.0)
    ckpt, step, rng = out / "checkpoint.pt", 0, np.random.default_rng(opts.seed)
    if resume and ckpt.exists():
        state = torch.load(ckpt, weights_only=False)
        head.load_state_dict(state["head"])
        opt.load_state_dict(state["opt"])
        step, rng = state["step"], np.random.default_rng(state["seed"] + state["step"])
        _log(f"resumed at step {step}")
    held = examples[-max(1, len(examples) // 10):]
    train_set = examples[:len(examples) - len(held)] or examples
    t0, budget = time.monotonic(), opts.minutes * 60

    def progress() -> float:  # the fraction of the run done: by steps when counted, else by time
        return step / opts.steps if opts.steps else (time.monotonic() - t0) / budget

    head.train()
    batches, agree = _batches(train_set, min(opts.batch, len(train_set)), rng), []
    with _bar(opts.steps, "training") as bar:
        while (frac := progress()) < 1:
            for g in opt.param_groups:  # warm-up, then cosine over the run
                g["lr"] = opts.lr * (min(1.0, (step + 1) / 20)) * 0.5 * (1 + math.cos(math.pi * min(frac, 1)))
            tokens, feats, labels = next(batches)
            loss, agree = ttt_loss(head, tokens, feats, labels, opts.ttt_steps)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            step += 1
            bar.update(1)
            bar.set_postfix_str(f"loss {loss.item():.3f} top1 " + " ".join(f"{a:.2f}" for a in agree))
            if step % opts.save_every == 0:
                torch.save({"head": head.state_dict(), "opt": opt.state_dict(), "step": step, "seed": opts.seed},
                           ckpt)
    torch.save({"head": head.state_dict(), "opt": opt.state_dict(), "step": step, "seed": opts.seed}, ckpt)
    head.eval()
    return {"steps": step, "held_out_top1": evaluate(head, held, opts.ttt_steps), "train_top1_last": agree}


@torch.no_grad()
def evaluate(head: EagleHead, examples: list[D.Example], steps: int) -> list[float]:
    """Top-1 agreement with the target per TTT step on held-out sequences."""
    sums = np.zeros(steps)
    for ex in examples:
        _, agree = ttt_loss(head, torch.as_tensor(ex.tokens[None]), torch.as_tensor(ex.features[None].astype(np.float32)),
                            torch.as_tensor(ex.labels[None].astype(np.float32)), steps)
        sums += agree
    return [round(float(x), 3) for x in sums / max(1, len(examples))]


def train_head(cfg, out: Path, opts: TrainOptions, resume: bool = False) -> dict:
    """The whole pipeline for the config's target; returns a report (also out/report.json)."""
    from hetero_sd.drafting.specs import ModelSpec
    from hetero_sd.engine import Engine
    from hetero_sd.loading import Loader
    from hetero_sd.spec import spec_from_config

    t0 = time.monotonic()
    out.mkdir(parents=True, exist_ok=True)
    (out / "data").mkdir(exist_ok=True)
    target_spec = spec_from_config(cfg, target_only=True).target
    load = Loader(progress=True)
    target_ir = load.ir(target_spec.model)
    head_cfg = HeadConfig.for_target(target_ir.config, opts.draft_vocab, opts.aux_layers)
    layers = head_cfg.feature_layers
    runner = load(ModelSpec(**{**asdict(target_spec), "features": layers}))
    engine = Engine(runner, None, tokenizer=load.tokenizer(target_spec.model),
                    eos_ids=tuple(target_ir.config.eos_token_ids), chat_template=cfg.generation.chat_template)
    _log(f"target {Path(target_spec.model).name} on {target_spec.backend}:{target_spec.precision}; "
         f"head reads layers {layers}, draft vocabulary {head_cfg.draft_vocab}")
    seqs = make_sequences(engine, opts, out / "data" / "sequences.json")
    t_data = time.monotonic()
    eos = tuple(target_ir.config.eos_token_ids)
    draft_ids = D.draft_vocab(seqs, head_cfg.draft_vocab, target_ir.config.vocab_size, eos)
    coverage = float(np.isin(np.concatenate([np.asarray(s) for s in seqs]), draft_ids).mean())
    examples = make_examples(runner, seqs, draft_ids, out / "data" / f"examples-{head_cfg.draft_vocab}.npz")
    t_pass = time.monotonic()
    head = init_head(head_cfg, target_ir, draft_ids, opts.seed)
    result = train(head, examples, opts, out, resume)
    head.save(out)
    report = {"sequences": len(seqs), "tokens": int(sum(len(s) for s in seqs)), "draft_vocab_coverage": round(coverage, 4),
              "data_s": round(t_data - t0), "target_pass_s": round(t_pass - t_data),
              "train_s": round(time.monotonic() - t_pass), **result, "options": asdict(opts)}
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    return report
