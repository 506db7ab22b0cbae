"""What a RemoteDrafter and its worker say to each other over a transport.

Engine -> worker: one packed work-IR record per message (no pickling):
  DraftRequest (ir/work.py)   draft up to k tokens              reply: DRAFT
  Control(HELLO)              are you loaded?                   reply: READY (vocab, max_context)
  Control(BEGIN, capacity,    start a sequence; `words` carry    reply: ACK
          words)              the sampling state (empty: greedy)
  Control(RESET)              forget the sequence               reply: ACK
Every request gets exactly one reply, in order, so the engine always knows
which reply it is reading; anything else is a malformed reply.

Worker -> engine: one frame (transport.pack_frame) per reply:
  refs   the draft distributions' TensorRef when they travel through a data plane
         (transport/planes.py: the shm arena, or CUDA IPC buffers)
  record Reply header | body | buffer announcements | inline distributions
         (announcements: a CUDA IPC plane's handles, each once, in the first reply
         that refers to its buffer; inline: transports without an arena)
A Ray actor's distributions travel beside the frame instead, as a numpy array
in Ray's object store (Transport.take_tensor).
The body of DRAFT is a packed DraftResult, of READY a Control, of an error
"ErrorClass: message" in UTF-8.

Sampling state: the request's draft random stream moves to the worker at
BEGIN. `words` hold temperature, top_p, top_k and the draft generator's
PCG64 state, so the worker draws exactly what an in-process drafter handed
the same Sampler would draw.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field

import numpy as np

from hetero_sd.ir.work import DraftResult, _Record
from hetero_sd.sampling import Sampler, SamplingParams
from hetero_sd.scheduler.mode import RequestMode
from hetero_sd.scheduler.round import Round
from hetero_sd.transport import CorruptRecord, pack_frame, unpack_frame
from hetero_sd.transport.planes import HostReader, HostWriter

HELLO, BEGIN, RESET, READY, ACK, DRAFT = 1, 2, 3, 4, 5, 6  # Control ops / what a reply answers
OK, ERROR = 0, 1  # reply status
FRESH, PARTIAL, AHEAD = 0, 1, 2  # async: drafted on request, partly or wholly pre-drafted


@dataclass
class Control(_Record):
    """A control request (or the READY body): op, one argument, int32 words."""

    KIND = 16
    op: int
    arg: int = 0
    words: list[int] = field(default_factory=list)  # [n] int32


# status, answers (op), source (FRESH/PARTIAL/AHEAD), body bytes, announcement bytes,
# seconds computed for this reply, seconds spent drafting ahead since the previous reply, and of the seconds
# computed, those of a catch-up (Round.catch_up_s)
_HEADER = struct.Struct("<iiiIIddd")


@dataclass
class Reply:
    status: int
    answers: int
    body: bytes = b""
    source: int = FRESH
    compute_s: float = 0.0
    ahead_s: float = 0.0
    catch_up_s: float = 0.0  # a FRESH draft's Round.catch_up_s (scheduler/round.py)
    probs: np.ndarray | None = None  # [rows, vocab] float64 (DRAFT under sampling)
    region: int | None = None  # the arena region `probs` is a view of (release it after use)


def encode_reply(channel, reply: Reply, plane=None) -> bytes:
    """The frame for `reply`; its distributions go into `plane` (planes.writer_for;
    None: the channel's host arena, when it has one), inline after the body otherwise."""
    refs, announce, inline = [], b"", b""
    if plane is None and channel.tx_arena is not None:
        plane = HostWriter(channel.tx_arena)
    if reply.probs is not None:
        probs = reply.probs if _on_device(reply.probs) else np.ascontiguousarray(reply.probs, dtype=np.float64)
        if plane is not None:
            ref, view = plane.claim(timeout=30.0).alloc(tuple(probs.shape), np.float64)
            plane.write(view, probs)
            plane.flush()  # the bytes are in place before the record naming them is sent
            refs, announce = [ref], plane.announcements()
        else:
            inline = np.ascontiguousarray(probs, dtype=np.float64).tobytes()
    head = _HEADER.pack(reply.status, reply.answers, reply.source, len(reply.body), len(announce),
                        reply.compute_s, reply.ahead_s, reply.catch_up_s)
    return pack_frame(head + reply.body + announce + inline, refs)


def _on_device(probs) -> bool:
    """A torch tensor (a GPU drafter's rows): a device plane copies it as it is."""
    return type(probs).__module__.startswith("torch")


def error_reply(answers: int, exc: BaseException) -> Reply:
    return Reply(ERROR, answers, f"{type(exc).__name__}: {exc}".encode()[:4000])


def decode_reply(channel, frame: bytes, vocab: int, plane=None) -> Reply:
    """Parse a frame; raises CorruptRecord when it is not a well-formed reply (and
    IpcOwnerGone, a TransportError, for rows whose owner died). Distributions come
    back through `plane` (planes.reader_for; None: the channel's host arena): a
    read-only zero-copy view of the shm arena, a host copy of CUDA IPC rows."""
    try:
        record, refs = unpack_frame(frame)
        status, answers, source, n_body, n_announce, compute_s, ahead_s, catch_up_s = \
            _HEADER.unpack_from(record, 0)
    except struct.error as exc:
        raise CorruptRecord(f"reply of {len(frame)} bytes is not a worker frame: {exc}") from None
    body_end = _HEADER.size + n_body
    if plane is None and channel.rx_arena is not None:
        plane = HostReader(channel.rx_arena)
    if n_announce:  # handles come first: the refs below may name the buffers they open
        if plane is None or body_end + n_announce > len(record):
            raise CorruptRecord(f"reply announces {n_announce} bytes of buffers on a channel without a data plane")
        plane.accept(record[body_end:body_end + n_announce])
        body_end += n_announce  # (the inline rows follow the announcements)
    if status not in (OK, ERROR) or source not in (FRESH, PARTIAL, AHEAD) or body_end > len(record):
        raise CorruptRecord(f"reply header (status {status}, source {source}, body {n_body} bytes) "
                            f"does not fit a {len(record)}-byte record")
    if not 0.0 <= catch_up_s <= compute_s:
        raise CorruptRecord(f"reply says {catch_up_s} s of its {compute_s} s computed were a catch-up")
    reply = Reply(status, answers, bytes(record[_HEADER.size:_HEADER.size + n_body]), source, compute_s, ahead_s,
                  catch_up_s)
    inline = record[body_end:]
    side = channel.take_tensor()  # beside the frame: Ray's object store
    if side is not None:
        if refs or inline or side.ndim != 2 or side.shape[1] != vocab or side.dtype != np.float64:
            raise CorruptRecord(f"reply carries distributions {side.dtype}{list(side.shape)} beside the frame "
                                f"and {len(refs)} tensor refs, {len(inline)} inline bytes in it")
        reply.probs = side
    elif refs:
        if len(refs) != 1 or plane is None or inline:
            raise CorruptRecord(f"reply carries {len(refs)} tensor refs and {len(inline)} inline bytes")
        reply.probs = plane.read(refs[0])
        reply.region = refs[0].region
    elif inline:
        if len(inline) % (8 * vocab):
            raise CorruptRecord(f"{len(inline)} inline bytes are not whole rows of {vocab} float64")
        reply.probs = np.frombuffer(inline, dtype=np.float64).reshape(-1, vocab)
    return reply


def parse_draft(reply: Reply, seq_id: int, k: int, vocab: int, rnd: Round | None = None) -> DraftResult:
    """The DraftResult in a DRAFT reply, checked against the request; the reply's catch-up
    seconds go to the round's record."""
    try:
        result = DraftResult.unpack(reply.body)
    except (ValueError, struct.error) as exc:
        raise CorruptRecord(f"DRAFT reply body is not a DraftResult: {exc}") from None
    if result.seq_id != seq_id or len(result.tokens) > k:
        raise CorruptRecord(f"draft reply for sequence {result.seq_id} with {len(result.tokens)} tokens; "
                            f"asked sequence {seq_id} for at most {k}")
    if any(not 0 <= t < vocab for t in result.tokens):
        raise CorruptRecord(f"draft reply holds token ids outside the vocabulary [0, {vocab}): {result.tokens}")
    if reply.probs is not None:
        if reply.probs.shape != (len(result.tokens), vocab):
            raise CorruptRecord(f"draft distributions of shape {reply.probs.shape} for "
                                f"{len(result.tokens)} tokens over {vocab}")
        result.probs = reply.probs
    if rnd is not None:
        rnd.catch_up_s = reply.catch_up_s
    return result


# ----------------------------------------------------------------------------- sampling state
_PARAMS = struct.Struct("<ddi")  # temperature, top_p, top_k
_STATE = struct.Struct("<16s16siI")  # PCG64 state, increment, has_uint32, uinteger
_MODE = struct.Struct("<i")  # the request's mode (scheduler/mode.py): seeded, one_hot, concurrent bits


def sampling_words(sampler: Sampler | None) -> list[int]:
    """BEGIN's words: the sampling parameters, the draft stream's state and the request's mode."""
    if sampler is None:
        return []
    p, state = sampler.params, sampler.draft_rng.bit_generator.state
    if state.get("bit_generator") != "PCG64":
        raise ValueError(f"draft streams cross processes as PCG64 state; got {state.get('bit_generator')}")
    raw = _PARAMS.pack(p.temperature, p.top_p, p.top_k) + _STATE.pack(
        state["state"]["state"].to_bytes(16, "little"), state["state"]["inc"].to_bytes(16, "little"),
        state["has_uint32"], state["uinteger"])
    mode = sampler.mode
    raw += _MODE.pack(int(mode.seeded) | int(mode.one_hot) << 1 | int(mode.concurrent) << 2)
    return np.frombuffer(raw, dtype="<i4").tolist()


def sampler_from_words(words: list[int]) -> Sampler | None:
    """The worker's Sampler: same warp, the engine's draft stream where it left off, the request's mode."""
    if not words:
        return None
    raw = np.asarray(words, dtype="<i4").tobytes()
    size = _PARAMS.size + _STATE.size + _MODE.size
    if len(raw) != size:
        raise CorruptRecord(f"BEGIN carries {len(raw)} bytes of sampling state, expected {size}")
    temperature, top_p, top_k = _PARAMS.unpack_from(raw, 0)
    state, inc, has_uint32, uinteger = _STATE.unpack_from(raw, _PARAMS.size)
    (bits,) = _MODE.unpack_from(raw, _PARAMS.size + _STATE.size)
    mode = RequestMode(greedy=False, seeded=bool(bits & 1), one_hot=bool(bits & 2), concurrent=bool(bits & 4))
    sampler = Sampler(SamplingParams(temperature, top_k, top_p, seed=0), mode)
    bit_gen = np.random.PCG64()
    bit_gen.state = {"bit_generator": "PCG64",
                     "state": {"state": int.from_bytes(state, "little"), "inc": int.from_bytes(inc, "little")},
                     "has_uint32": has_uint32, "uinteger": uinteger}
    sampler.draft_rng = np.random.Generator(bit_gen)
    return sampler
