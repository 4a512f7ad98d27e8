"""Step-time cost models: what one forward step of a scheduled batch costs.

A step is described by `StepShape` (what the real scheduler put in the batch). Two models share the
`step_time(shape) -> seconds` interface:

- `LinearCostModel` (calibrated): step = a + e*[step has prefill] + b*prefill_tokens + c*decode_seqs
  + d*sum_context + f*prefill_pairs, fitted by least squares to step times the real engine took on this machine
  (`profile`, `pdserve sim profile`), saved as JSON. It is a *prediction* for this machine and model, valid inside
  the profiled range.

  Why a second intercept: a step with only decode sequences runs as one native call over the whole layer stack
  (engine/decoder_stack.py) where a step holding a prefill chunk runs the per-layer Python loop, so the two have
  different fixed costs (fitted 1.7 vs 2.8 ms on the built-in model, one core of an Intel Xeon; docs/sim.md). With
  one shared intercept the fit splits the difference and short prefills come out short. The prefill attention term
  is quadratic in the chunk (a 1000-token prompt's causal pairs), which `b` alone cannot follow.
- `pdserve.sim.roofline.RooflineCostModel`: a *lower bound* for a named GPU and model.
"""
from __future__ import annotations

import json
import math
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class StepShape:
    prefill_tokens: int = 0   # tokens of sequences still in prefill (chunks, recomputes)
    prefill_seqs: int = 0
    decode_seqs: int = 0      # sequences computing exactly their one new token
    sum_context: int = 0      # over scheduled sequences: KV positions the last computed position attends to
    attn_pairs: int = 0       # causal (query, key) pairs computed: n*start + n(n+1)/2 per chunk, start+1 per decode
    samples: int = 0          # sequences whose chunk reaches their end (one logits row, one sampled token each)
    prefill_pairs: int = 0    # the part of attn_pairs computed by prefill chunks

    @property
    def tokens(self) -> int:
        return self.prefill_tokens + self.decode_seqs

    @classmethod
    def of_scheduled(cls, scheduled) -> "StepShape":
        """From a `SchedulerOutput.scheduled` list, before the step advances `num_computed_tokens`."""
        pt = ps = ds = ctx = attn = smp = ppairs = 0
        for it in scheduled:
            seq, n = it.seq, it.num_tokens
            start = seq.num_computed_tokens
            ctx += start + n
            smp += start + n == seq.num_tokens
            if seq.is_prefill:
                pt += n
                ps += 1
                pairs = n * start + n * (n + 1) // 2  # query-key pairs of a causal chunk after `start` cached
                attn += pairs
                ppairs += pairs
            else:
                ds += 1
                attn += start + 1
        return cls(pt, ps, ds, ctx, attn, smp, ppairs)

    @classmethod
    def prefill(cls, n: int) -> "StepShape":
        """One whole n-token prompt, nothing cached, nothing else in the step."""
        return cls(prefill_tokens=n, prefill_seqs=1, sum_context=n, attn_pairs=n * (n + 1) // 2, samples=1,
                   prefill_pairs=n * (n + 1) // 2)

    @classmethod
    def decode(cls, n: int, context: int) -> "StepShape":
        """n decode sequences whose contexts sum to `context`."""
        return cls(decode_seqs=n, sum_context=context, attn_pairs=context, samples=n)


@dataclass
class LinearCostModel:
    a: float = 0.005          # s per step
    b: float = 1e-4           # s per prefill token
    c: float = 1e-3           # s per decode sequence
    d: float = 0.0            # s per context token (sum over scheduled sequences)
    e: float = 0.0            # s per step that holds any prefill chunk, on top of `a`
    f: float = 0.0            # s per prefill (query, key) attention pair
    # The first step after the engine sat idle costs more: measured on a 2-vCPU KVM guest, a 32-token prefill took
    # 3.7 ms back to back and 4.9 / 5.8 / 6.2 ms after 20 / 100 / 300 ms idle (caches and the vCPU going cold;
    # a GPU's clocks drop when idle too). Modelled as wake_s * (1 - exp(-idle / wake_tau_s)), fitted by `profile`.
    # At light load every request meets an idle engine, so without it short prompts' TTFT came out ~35% short.
    wake_s: float = 0.0
    wake_tau_s: float = 0.04
    # KV handoff between replicas (disaggregation): bytes per token and link bandwidth, plus a fixed overhead.
    kv_bytes_per_token: float = 0.0
    link_bytes_per_s: float = 1e9
    handoff_s: float = 0.0
    meta: dict = field(default_factory=dict)  # where the numbers came from (machine, model, fit residuals)

    kind = "linear"

    def step_time(self, s: StepShape) -> float:
        return (self.a + (self.e if s.prefill_seqs else 0.0) + self.b * s.prefill_tokens + self.c * s.decode_seqs
                + self.d * s.sum_context + self.f * s.prefill_pairs)

    def wake_time(self, idle_s: float) -> float:
        """Extra time of a step that starts `idle_s` after the previous one ended."""
        if self.wake_s <= 0 or idle_s <= 0:
            return 0.0
        return self.wake_s * -math.expm1(-idle_s / self.wake_tau_s)

    def transfer_time(self, num_tokens: int) -> float:
        return self.handoff_s + num_tokens * self.kv_bytes_per_token / self.link_bytes_per_s

    # ---- persistence ------------------------------------------------------------------------------------------
    def to_json(self) -> dict:
        return {"kind": self.kind, **asdict(self)}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2))

    @classmethod
    def load(cls, path: str | Path) -> "LinearCostModel":
        d = json.loads(Path(path).read_text())
        d.pop("kind", None)
        return cls(**d)

    # ---- fitting ----------------------------------------------------------------------------------------------
    @staticmethod
    def _nnls(X, y):
        """Active-set least squares: drop the most negative slope and refit (a step never gets cheaper with
        more work); the intercept is clipped at 0."""
        import numpy as np

        # Columns span ~1 (intercepts) to ~1e6 (attention pairs): solve on unit-scaled columns, scale back.
        scale = np.abs(X).max(axis=0)
        scale[scale == 0] = 1.0
        Xs = X / scale
        active = list(range(X.shape[1]))
        coef = np.zeros(X.shape[1])
        while active:
            sol, *_ = np.linalg.lstsq(Xs[:, active], y, rcond=None)
            neg = [(v, a) for v, a in zip(sol, active) if v < 0 and a != 0]
            if not neg:
                coef[active] = sol
                coef[0] = max(coef[0], 0.0)
                return coef / scale
            active.remove(min(neg)[1])
        return coef

    @classmethod
    def fit(cls, samples: list[tuple[StepShape, float]], **extra) -> "LinearCostModel":
        """Least squares with non-negative coefficients (a coefficient that comes out negative is dropped and
        the rest refitted: a step never gets cheaper with more work)."""
        import numpy as np

        X = np.array([[1.0, s.prefill_tokens, s.decode_seqs, s.sum_context, float(s.prefill_seqs > 0),
                       s.prefill_pairs] for s, _ in samples], dtype=float)
        y = np.array([t for _, t in samples])
        keep = np.ones(len(y), dtype=bool)
        for _ in range(2):  # relative-error least squares; the second pass drops outliers (contended steps)
            coef = cls._nnls(X[keep] / y[keep, None], np.ones(int(keep.sum())))
            rel = np.abs(X @ coef - y) / y
            keep = rel <= max(3 * np.median(rel), 0.05)
        pred = X @ coef
        rel = np.abs(pred - y) / np.maximum(y, 1e-9)
        meta = {"n_samples": len(samples), "n_outliers_dropped": int((~keep).sum()), "median_rel_err": float(np.median(rel)),
                "p90_rel_err": float(np.quantile(rel, 0.9)), **extra.pop("meta", {})}
        a, b, c, d, e, f = map(float, coef)
        return cls(a, b, c, d, e, f, meta=meta, **extra)


def load_cost_model(path: str | Path):
    d = json.loads(Path(path).read_text())
    if d.get("kind", "linear") != "linear":
        raise ValueError(f"{path}: unknown cost model kind {d.get('kind')!r}")
    return LinearCostModel.load(path)


# ---- profiling the real engine --------------------------------------------------------------------------------
def capture_shapes(engine) -> list:
    """Wrap this engine's scheduler (the instance, not the class) so every tick's batch shape is recorded
    before the step runs. Returns the list the shapes are appended to."""
    shapes: list = []
    sched = engine.scheduler
    orig = sched.schedule

    def schedule():
        out = orig()
        shapes.append(StepShape.of_scheduled(out.scheduled) if out.scheduled else None)
        return out

    sched.schedule = schedule
    return shapes


def timed_steps(engine, shapes: list) -> list[tuple[StepShape, float]]:
    """Step the engine until idle; pair each non-empty step's shape with its wall time."""
    out = []
    while engine.has_unfinished():
        n = len(shapes)
        t0 = time.perf_counter()
        engine.step()
        dt = time.perf_counter() - t0
        if len(shapes) > n and shapes[-1] is not None:
            out.append((shapes[-1], dt))
    return out


DEFAULT_GRID = {
    # (prompt_len, batch, max_tokens): pure prefills of several sizes, decode batches at several contexts,
    # and mixes (arrivals during decodes come from the staggered adds below).
    "prefill": [(16, 1), (64, 1), (128, 2), (256, 1), (512, 1), (512, 2), (1000, 1)],
    "decode": [(16, 1, 12), (16, 2, 12), (16, 4, 12), (16, 8, 12), (16, 16, 12), (16, 32, 12), (16, 64, 8),
               (256, 8, 12), (512, 4, 12), (128, 24, 8), (700, 2, 8)],
}


def profile(model: str = "builtin", *, threads: int | None = 1, repeats: int = 1, grid: dict | None = None,
            num_gpu_blocks: int = 4096, max_num_batched_tokens: int = 2048, log=None,
            kv_cache_dtype: str = "auto") -> LinearCostModel:
    """Run the real engine over a grid of prefill sizes, decode batches and contexts; fit the linear model.
    `kv_cache_dtype`: the pool the steps run over; the model's kv_bytes_per_token (the transfer term) is the
    pool's element size, apart from the weights'."""
    import platform

    import torch

    from pdserve.engine.engine import Engine, EngineConfig
    from pdserve.engine.sampling_params import SamplingParams

    if threads:
        torch.set_num_threads(threads)
    grid = grid or DEFAULT_GRID
    cfg = EngineConfig(num_gpu_blocks=num_gpu_blocks, max_num_batched_tokens=max_num_batched_tokens,
                       enable_prefix_caching=False, max_num_seqs=256, kv_cache_dtype=kv_cache_dtype)
    eng = Engine.from_pretrained(model, cfg)
    shapes = capture_shapes(eng)
    vocab = eng.model_config.vocab_size
    counter = [0]

    def add(plen: int, maxtok: int) -> None:
        counter[0] += 1
        k = counter[0]
        prompt = [3 + (k * 131 + j * 17) % (vocab - 3) for j in range(plen)]
        eng.add_request(f"p{k}", prompt, SamplingParams(max_tokens=maxtok, ignore_eos=True, temperature=0))

    def one_pass() -> list[tuple[StepShape, float]]:
        samples: list[tuple[StepShape, float]] = []
        for plen, b in grid["prefill"]:
            for _ in range(b):
                add(plen, 1)
            samples += timed_steps(eng, shapes)
        for plen, b, m in grid["decode"]:
            for _ in range(b):
                add(plen, m)
            samples += timed_steps(eng, shapes)
        # mixed: a decode batch running while new prompts arrive every other step
        for _ in range(8):
            add(32, 24)
        i = 0
        while eng.has_unfinished():
            if i in (4, 8, 12):
                add(200, 4)
            i += 1
            n = len(shapes)
            t0 = time.perf_counter()
            eng.step()
            dt = time.perf_counter() - t0
            if len(shapes) > n and shapes[-1] is not None:
                samples.append((shapes[-1], dt))
        return samples

    # The first pass is warm-up and is dropped: the first step of each new shape pays allocator and math-library
    # first-use costs (oneDNN creates a primitive per shape), up to several times a warm step, which a serving
    # worker pays once at start-up and which would otherwise inflate the small-prefill fit the most.
    one_pass()
    samples: list[tuple[StepShape, float]] = []
    for _ in range(repeats):
        samples += one_pass()
    wake_s, wake_tau_s = measure_wake(eng, lambda: add(32, 1))
    mc = eng.model_config
    kv_bpt = 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * eng.kv_cache.data.element_size() \
        if hasattr(eng.kv_cache, "data") else 0
    link = measure_copy_bandwidth()
    if log:
        log(f"profiled {len(samples)} steps")
    return LinearCostModel.fit(samples, kv_bytes_per_token=float(kv_bpt), link_bytes_per_s=link, handoff_s=0.005,
                               wake_s=wake_s, wake_tau_s=wake_tau_s,
                               meta={"model": str(model), "machine": platform.node(), "torch_threads":
                                     torch.get_num_threads(), "link": "host memcpy bandwidth (in-machine copy); "
                                     "handoff_s is a fixed 5 ms allowance for the pull/commit round trip"})


WAKE_GAPS_S = (0.01, 0.03, 0.1, 0.3)


def measure_wake(engine, add_one, reps: int = 5) -> tuple[float, float]:
    """(wake_s, wake_tau_s): how much longer one short prefill step takes after the engine sat idle, against the
    same step back to back, at idle gaps WAKE_GAPS_S: the saturation is the extra at the longest gap, the time
    constant the least-squares fit over all of them. (0, default tau) when the extra is under 5% of the step."""
    def step_after(gap: float) -> float:
        add_one()
        time.sleep(gap)
        t0 = time.perf_counter()
        engine.step()
        dt = time.perf_counter() - t0
        while engine.has_unfinished():
            engine.step()
        return dt

    step_after(0.0)
    hot = statistics.median([step_after(0.0) for _ in range(2 * reps)])
    extra = [statistics.median([step_after(g) for _ in range(reps)]) - hot for g in WAKE_GAPS_S]
    wake = extra[-1]
    if wake < 0.05 * hot:
        return 0.0, LinearCostModel.wake_tau_s
    taus = [0.002 * 1.1 ** k for k in range(60)]  # 2 ms .. ~0.6 s
    tau = min(taus, key=lambda tau: sum((x + wake * math.expm1(-g / tau)) ** 2 for g, x in zip(WAKE_GAPS_S, extra)))
    return float(wake), float(tau)


def measure_copy_bandwidth(nbytes: int = 16 << 20) -> float:
    """Bytes copied per second by a plain torch copy of `nbytes` (mean of 5 after a warm-up)."""
    import torch

    # Both buffers written first: an untouched `torch.empty` source maps every page to the kernel's shared zero
    # page, which the copy then reads from cache (a ~1.5x overstated bandwidth here).
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros_like(src)
    dst.copy_(src)
    t0 = time.perf_counter()
    for _ in range(5):
        dst.copy_(src)
    return 5 * src.numel() / (time.perf_counter() - t0)
