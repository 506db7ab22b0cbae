"""`hetero-sd train-head`: train an EAGLE-3 head for the configured target, on this machine.

    train_head(load_config("configs/cpu.yaml"), Path("heads/smollm2"), TrainOptions(minutes=30))

Stages, each saved under `out/` so an interrupted run resumes where it stopped (a
finished stage is not run again):
  1. data/sequences.json   self-distilled responses (generated in batches) and teacher-forced
                           text found here (training/corpus.py), as token ids
  2. data/pass-F/          one target pass per sequence: features and final states on disk
                           (training/store.py), appended as it goes
  3. checkpoint.pt         head + optimizer every `save_every` steps (--resume continues)
  4. data/pass-BACKEND-PRECISION-F/, checkpoint-tune.pt   the serving backend's own states over
                           the responses, and a short run on them (`tune`)
  5. config.json, model.safetensors   the head in EAGLE-3's layout (what `drafter.head` reads)
Stages 1 and 2 run the target in transformers (training/reference.py: batched,
bf16 where the CPU has it), fast; stage 4 runs the configured target itself.
"""
from __future__ import annotations

import json
import math
import os
import pickle
import sys
import time
from dataclasses import asdict, replace
from functools import partial
from pathlib import Path

import numpy as np
import torch

from hetero_sd.ir.eog import eog_ids
from hetero_sd.ir.eagle import EagleHead, HeadConfig
from hetero_sd.training import corpus as C
from hetero_sd.training import data as D
from hetero_sd.training.options import TrainOptions
from hetero_sd.training.reference import Reference, fast_dtype
from hetero_sd.training.store import ExampleStore
from hetero_sd.training.ttt import ttt_loss


def _log(msg: str) -> None:
    print(f"[train-head] {msg}", file=sys.stderr, flush=True)


def _bar(total: int, desc: str, unit: str = "it"):
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, unit=unit, leave=False)


def make_sequences(ref: Reference, tokenizer, chat: bool, eos: tuple[int, ...], opts: TrainOptions,
                   path: Path) -> list[dict]:
    """Prompt + the target's greedy response for every prompt, then teacher-forced text."""
    from hetero_sd.engine import encode_text

    seqs = json.loads(path.read_text()) if path.exists() else []
    prompts = D.instruction_prompts()
    prompts = (prompts + D.grounded_prompts(max(0, opts.prompts - len(prompts)), opts.seed))[:opts.prompts]
    done = sum(1 for s in seqs if s["kind"] == "response")
    ask = [encode_text(tokenizer, p, chat)[-opts.seq_len // 2:] for p in prompts]
    with _bar(len(prompts), "self-distillation", "prompt") as bar:
        bar.update(done)
        for start in range(done, len(prompts), opts.gen_batch):
            batch = ask[start:start + opts.gen_batch]
            outs = ref.generate(batch, opts.max_new_tokens, eos, batch=opts.gen_batch)
            seqs += [{"kind": "response", "ids": a + o} for a, o in zip(batch, outs)]
            path.write_text(json.dumps(seqs))  # after each batch: an interrupted run keeps what it made
            bar.update(len(batch))
    if all(s["kind"] == "response" for s in seqs):
        text = lambda t: list(tokenizer(t, add_special_tokens=False)["input_ids"])  # noqa: E731
        for source, request, body in C.teacher_texts(opts.text_chars, opts.seed):
            seqs += [{"kind": source, "ids": ids} for ids in
                     C.as_chat(lambda r: encode_text(tokenizer, r, chat), text, request, body, opts.seq_len)]
        chunks = D.source_chunks(text, opts.source_chunks, opts.seq_len, opts.seed) if opts.source_chunks else []
        seqs += [{"kind": "source", "ids": c} for c in chunks]
        path.write_text(json.dumps(seqs))
    return seqs


def make_store(states, seqs: list[list[int]], widths: tuple[int, int], folder: Path, desc: str) -> ExampleStore:
    """`states(ids) -> (features, final)` for every sequence, appended to `folder` (resumes where it
    stopped)."""
    store = ExampleStore(folder, *widths)
    with _bar(sum(len(s) for s in seqs), desc, "tok") as bar:
        bar.update(sum(len(s) for s in seqs[:len(store)]))
        for ids in seqs[len(store):]:
            store.append(ids, *states(ids))
            bar.update(len(ids))
    return store


def serving_states(runner, layers: tuple[int, ...], target_ir):
    """The serving target's states of a sequence: its feature layers, and its last layer's output
    (asked for as one more feature layer) through the final norm."""
    norm = target_ir.weights.get("model.norm.weight").float()
    eps, H = target_ir.config.rms_norm_eps, target_ir.config.hidden_size

    def states(ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
        sid = runner.allocate(len(ids))
        try:
            runner.forward(sid, ids, 0, len(ids))
            f = runner.take_features(sid)
        finally:
            runner.release(sid)
        last = torch.as_tensor(f[:, -H:]).float()
        final = last * torch.rsqrt(last.pow(2).mean(-1, keepdim=True) + eps) * norm
        return f[:, :-H].astype(np.float16), final.to(torch.float16).numpy()
    return states


def tune(head: EagleHead, target_spec, target_ir, seqs: list[list[int]], lm: torch.Tensor, opts: TrainOptions,
         out: Path, resume: bool) -> dict:
    """Stage 2: the serving backend's own states over the self-distilled responses, and a short
    run of training on them at a third of the learning rate. Its int8 / int4 kernels move the
    states a little (SmolLM2 int4 on onnxruntime: cosine 0.976 to the exact ones at layer 26),
    and the head drafts from those."""
    from hetero_sd.loading import Loader

    layers = head.cfg.feature_layers
    runner = Loader(progress=True)(replace(target_spec, features=layers + (target_ir.config.num_layers - 1,)))
    H = target_ir.config.hidden_size
    store = make_store(serving_states(runner, layers, target_ir), seqs, (len(layers) * H, H),
                       out / "data" / f"pass-{target_spec.backend}-{target_spec.precision}-{len(layers)}",
                       f"target pass ({target_spec.backend} {target_spec.precision})")
    runner.close()
    t = time.monotonic()
    result = train(head, store, lm, replace(opts, minutes=opts.tune_minutes, steps=opts.tune_steps, lr=opts.lr / 3),
                   out / "checkpoint-tune.pt", resume, fast_dtype(opts.dtype))
    return {"tune_tokens": store.rows, "tune_s": round(time.monotonic() - t), "tune_steps": result["steps"],
            "tune_held_out_top1": result["held_out_top1"]}


def lm_rows(target_ir, draft_ids: np.ndarray) -> torch.Tensor:
    """[draft vocabulary, hidden] fp32: the target's output rows of the draft vocabulary."""
    w = target_ir.weights
    lm = w.get("model.embed_tokens.weight" if target_ir.config.tie_word_embeddings else "lm_head.weight")
    return lm.float()[torch.as_tensor(draft_ids, dtype=torch.long)].clone()


def init_head(cfg: HeadConfig, target_ir, draft_ids: np.ndarray, seed: int) -> EagleHead:
    """Random layer (seeded); LM head and final norm from the target's, restricted to the draft vocabulary."""
    torch.manual_seed(seed)
    head = EagleHead(cfg, target_ir.weights.get("model.embed_tokens.weight").float())
    head.set_vocab(torch.as_tensor(draft_ids))
    with torch.no_grad():
        head.lm_head.weight.copy_(lm_rows(target_ir, draft_ids))
        head.norm.copy_(target_ir.weights.get("model.norm.weight").float())
        for lin in (head.q_proj, head.k_proj, head.v_proj, head.o_proj, head.gate_proj, head.up_proj,
                    head.down_proj, head.fc):
            lin.weight.mul_(0.5)
    return head


def _sampler(store: ExampleStore, train_ids: np.ndarray, lm_rows: torch.Tensor, opts: TrainOptions,
             rng: np.random.Generator):
    """Batches of `batch` windows: an anchor sequence sets the length (up to `window`), the rest
    are drawn from sequences at least that long, each window at a random start."""
    lengths = np.array([store.length(i) for i in train_ids])
    while True:
        T = int(min(opts.window, lengths[rng.integers(len(train_ids))]))
        pool = train_ids[lengths >= T]
        picks = [store.window(i, int(rng.integers(store.length(i) - T + 1)), T)
                 for i in rng.choice(pool, size=min(opts.batch, len(pool)), replace=False)]
        tokens, feats, final = (torch.as_tensor(np.stack(x)) for x in zip(*picks))
        yield tokens, feats.float(), final.float() @ lm_rows.T


def _autocast(dtype: torch.dtype):
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16)


def save_checkpoint(path: Path, state: dict) -> None:
    """Write `state` to `path` whole or not at all: into a temporary file in the same folder, flushed
    to disk, then renamed over `path` (a crash mid-write leaves the previous checkpoint intact).
    `state` holds only what `load_checkpoint`'s restricted unpickler reads back: tensors, dicts,
    lists, tuples, strings, ints, floats, bools and None."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    try:  # the rename itself survives a power cut once the folder's entry is on disk
        fd = os.open(path.parent, os.O_RDONLY)
    except OSError:  # a platform without directory handles (Windows)
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def load_checkpoint(path: Path) -> dict:
    """A checkpoint `save_checkpoint` wrote, read with torch's weights-only unpickler: a file that
    holds anything but plain data (an object whose unpickling would run code) is refused."""
    from hetero_sd.errors import ConfigError

    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"{path}: refused: not a plain-data training checkpoint ({first[:200]}); "
                          "delete it to train from the start") from None
    if not isinstance(state, dict) or not {"head", "opt", "step", "seed"} <= state.keys():
        raise ConfigError(f"{path}: not a training checkpoint (no head, opt, step and seed); "
                          "delete it to train from the start")
    return state


def train(head: EagleHead, store: ExampleStore, lm_rows: torch.Tensor, opts: TrainOptions, ckpt: Path,
          resume: bool, dtype: torch.dtype = torch.float32) -> dict:
    """Train to the time or step budget; a checkpoint every `save_every` steps. A resumed run
    continues from `ckpt`, and one that had finished is not trained again."""
    head.lm_head.weight.requires_grad_(opts.train_lm_head)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=opts.lr, weight_decay=0.0)
    step, rng, finished = 0, np.random.default_rng(opts.seed), False
    if resume and ckpt.exists():
        state = load_checkpoint(ckpt)
        head.load_state_dict(state["head"])
        opt.load_state_dict(state["opt"])
        step, rng = state["step"], np.random.default_rng(state["seed"] + state["step"])
        finished = state.get("finished", False)
        _log(f"{ckpt.name}: {'finished' if finished else 'resumed'} at step {step}")
    order = np.random.default_rng(opts.seed).permutation(len(store))  # held-out: a fixed random 2%
    n_held = max(1, len(store) // 50)
    held, train_ids = order[:n_held], (order[n_held:] if len(store) > n_held else order)
    t0, budget = time.monotonic(), opts.minutes * 60

    def progress() -> float:  # the fraction of the run done: by steps when counted, else by time
        return step / opts.steps if opts.steps else (time.monotonic() - t0) / budget

    def save(finished: bool = False) -> None:
        save_checkpoint(ckpt, {"head": head.state_dict(), "opt": opt.state_dict(), "step": int(step),
                               "seed": int(opts.seed), "finished": bool(finished)})

    head.train()
    batches, agree = _sampler(store, train_ids, lm_rows, opts, rng), []
    with _bar(opts.steps, "training", "step") as bar:
        while not finished and (frac := progress()) < 1:
            for g in opt.param_groups:  # warm-up, then cosine over the run
                g["lr"] = opts.lr * (min(1.0, (step + 1) / 20)) * 0.5 * (1 + math.cos(math.pi * min(frac, 1)))
            tokens, feats, labels = next(batches)
            with _autocast(dtype):
                loss, agree = ttt_loss(head, tokens, feats, labels, opts.ttt_steps)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            step += 1
            bar.update(1)
            bar.set_postfix_str(f"loss {loss.item():.3f} top1 " + " ".join(f"{a:.2f}" for a in agree))
            if step % opts.save_every == 0:
                save()
    save(finished=True)
    head.eval()
    return {"steps": step, "held_out_top1": evaluate(head, store, held[:48], lm_rows, opts.ttt_steps),
            "train_top1_last": [round(a, 3) for a in agree]}


@torch.no_grad()
def evaluate(head: EagleHead, store: ExampleStore, ids, lm_rows: torch.Tensor, steps: int) -> list[float]:
    """Top-1 agreement with the target per TTT step on held-out sequences (fp32)."""
    sums = np.zeros(steps)
    for i in ids:
        tokens, feats, final = store.window(int(i), 0, store.length(int(i)))
        _, agree = ttt_loss(head, torch.as_tensor(tokens[None]), torch.as_tensor(feats[None]).float(),
                            torch.as_tensor(final[None]).float() @ lm_rows.T, steps)
        sums += agree
    return [round(float(x), 3) for x in sums / max(1, len(ids))]


def train_head(cfg, out: Path, opts: TrainOptions, resume: bool = False, int8: bool = False) -> dict:
    """The whole pipeline for the config's target; returns a report (also out/report.json)."""
    from hetero_sd.loading import Loader
    from hetero_sd.spec import spec_from_config

    t0 = time.monotonic()
    (out / "data").mkdir(parents=True, exist_ok=True)
    target_spec = spec_from_config(cfg, target_only=True).target
    load = Loader(progress=True)
    target_ir = load.ir(target_spec.model)
    head_cfg = HeadConfig.for_target(target_ir.config, opts.draft_vocab, opts.aux_layers)
    layers, eos = head_cfg.feature_layers, eog_ids(target_ir, load.tokenizer(target_spec.model))
    ref = Reference.load(target_spec.model, fast_dtype(opts.dtype))
    _log(f"target {Path(target_spec.model).name} in transformers ({str(ref.dtype).split('.')[-1]}); "
         f"head reads layers {layers}, draft vocabulary {head_cfg.draft_vocab}")
    seqs = make_sequences(ref, load.tokenizer(target_spec.model), cfg.generation.chat_template, eos, opts,
                          out / "data" / "sequences.json")
    kinds: dict[str, int] = {}
    for s in seqs:
        kinds[s["kind"]] = kinds.get(s["kind"], 0) + len(s["ids"][:opts.seq_len])
    ids = [s["ids"][:opts.seq_len] for s in seqs]
    _log(f"data: {sum(kinds.values()):,} tokens in {len(ids):,} sequences ({kinds})")
    t_data = time.monotonic()
    draft_ids = D.draft_vocab(ids, head_cfg.draft_vocab, target_ir.config.vocab_size, eos)
    coverage = float(np.isin(np.concatenate([np.asarray(s) for s in ids]), draft_ids).mean())
    H = target_ir.config.hidden_size
    store = make_store(partial(ref.states, feature_layers=layers), ids, (len(layers) * H, H),
                       out / "data" / f"pass-{len(layers)}", "target pass")
    ref_dtype = ref.dtype
    del ref
    t_pass = time.monotonic()
    head = init_head(head_cfg, target_ir, draft_ids, opts.seed)
    lm = lm_rows(target_ir, draft_ids)
    result = train(head, store, lm, opts, out / "checkpoint.pt", resume, ref_dtype)
    if opts.tune_minutes or opts.tune_steps:
        responses = [s["ids"][:opts.seq_len] for s in seqs if s["kind"] == "response"]
        result.update(tune(head, target_spec, target_ir, responses, lm, opts, out, resume))
    head.save(out, int8=int8)
    report = {"sequences": len(ids), "tokens": int(sum(len(s) for s in ids)), "tokens_by_source": kinds,
              "draft_vocab_coverage": round(coverage, 4), "data_s": round(t_data - t0),
              "target_pass_s": round(t_pass - t_data), "train_s": round(time.monotonic() - t_pass), **result,
              "options": asdict(opts)}
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    return report
