"""Tile-quantised batch time of rad-slai.txt section 3.2 (eqs. 4-7) and Theorem 1's T^R."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from kvsched.cost.shape import BatchShape
from kvsched.hardware import GPU, Model


@dataclass(frozen=True)
class TiledCost:
    """Batch time of rad-slai.txt eq. (7): GEMMs charged per tile, with the paper's ceilings.

    For a batch with tau = prefill tokens + decodes (the token count, section 3.1 / eq. 4):

        T_B = lin_tile_s * ceil(tau / t_col)                                 linear GEMMs, eq. (4)
            + nonlin_token_s * tau                                       non-linear ops, 3.2.3
            + N * decode_attn_token_s * sum_j i_j                  decode attention, eq. (5)
            + pair_tile_s * N * sum_chunks [ ceil((p+c)/t_row) ceil(c/t_col) d/t_red
                                           + d/t_row ceil(c/t_col) ceil((p+c)/t_red) ]
                                                                      prefill attention, eq. (6)
        time  = overhead + max(T_B, weight_floor)

    N = model layers, d = heads * head_dim (the query/key width), i_j = context of decode j
    including the token it computes (`BatchShape.decode_ctx` is the sum), and each prefill chunk
    is (p tokens already cached, c new tokens): the paper's PI(R, i, c) with i = p + 1, so its
    i + c - 1 = p + c. lin_tile_s is 1/mu_Lin(t_row, t_col, t_red) of eq. (4), nonlin_token_s
    1/mu_nLin of section 3.2.3 and pair_tile_s 1/(s mu(t_row, t_col, t_red)) of eq. (6): seconds
    per (output tile x reduction tile) product.

    Decode attention drops eq. (5)'s GeMV ceilings. With 1/mu the GeMV time per tile,
    eq. (5) is T^{D,SA}(i) = (1/mu) (d/t_col ceil(i/t_row) + ceil(i/t_col) d/t_row); without the
    ceilings it is (1/mu) 2 d i / (t_row t_col), i.e. decode_attn_token_s = 2 d / (mu t_row t_col)
    per context token per layer. As 0 <= ceil(x) - x < 1, the exact minus the modelled time is in
    [0, (1/mu)(d/t_col + d/t_row)) = [0, decode_attn_token_s (t_row + t_col) / 2): per decode per
    layer the model undercounts by less than (t_row + t_col) / 2 context tokens' worth (under
    (t_row + t_col) / (2 i) relatively), and a batch of b decodes by less than
    N b decode_attn_token_s (t_row + t_col) / 2. (Eq. 5's GeMV tile may differ from the GEMM
    tile; the bound is stated with the model's t_row, t_col.) decode_attn_token_s left unset is
    taken from the catalogue as the KV read time, 2 kv_heads head_dim dtype_bytes / bandwidth
    per token per layer: decode attention is bandwidth-bound in practice.

    weight_floor and overhead are not in the paper: eq. (7) has no floor (a batch of one token
    costs one column tile) and no per-batch CPU/launch time. weight_floor > 0 makes a batch last
    at least the time to read the weights (about 15 ms for Mistral-7B bf16 at 0.96 TB/s);
    overhead is added to every batch. Both 0 by default.

    Shapes without `chunks` (aggregates, or numpy arrays of many batches as cost/fit.py builds)
    charge the prefill attention as if the batch's prefill_seqs chunks were equal: c = prefill
    tokens / prefill_seqs new tokens each over p = (prefill_ctx - prefill tokens) / prefill_seqs
    cached ones, ceilings taken of these (possibly fractional) means. Exact when all chunks
    share (p, c), e.g. one chunk per batch; otherwise the mean of ceilings and the
    (p + c) c products of unequal chunks differ from those of the means. With `chunks` given,
    eq. (7) is evaluated exactly.

    Tile defaults 128 x 128 (output) x 64 (reduction): the CTA tile cuBLAS/CUTLASS pick for
    large bf16 GEMMs on Ampere/Ada/Hopper tensor cores (128x128 output, K step 32-64 staged in
    shared memory); t_lcm = 128 is then RAD's chunk (Algorithm 1), and 2048-token prompts and
    the usual chunk budgets are whole tiles. The default coefficients are the paper's terms only
    (weight_floor = overhead = 0) least-squares fitted to the authors' Mistral-7B / RTX 6000 Ada
    batch times (benchmarks/fit_tiled.py): lin_tile_s = 10.64 ms, the others 0, which misses the
    measured batch times by up to 56% (eq. 7 has no per-batch constant). The
    `tiled-mistral-7b-rtx-6000-ada` preset (TILED_PRESETS) adds the weight floor and overhead
    and matches both measured columns within 4.9%. Fit your own for other models or GPUs.
    """
    model: Model
    gpu: GPU
    lin_tile_s: float = field(default=0.01064, metadata={
        "help": "seconds per column tile of the linear GEMMs, 1/mu_Lin of eq. (4)", "range": "[0, inf)"})
    nonlin_token_s: float = field(default=0.0, metadata={
        "help": "non-linear seconds per token, 1/mu_nLin (section 3.2.3)", "range": "[0, inf)"})
    pair_tile_s: float = field(default=0.0, metadata={
        "help": "prefill attention seconds per output tile x reduction tile, 1/(s mu) of eq. (6)",
        "range": "[0, inf)"})
    decode_attn_token_s: float | None = field(default=None, metadata={
        "help": "decode attention seconds per context token per layer (eq. 5 without ceilings); "
                "auto: KV bytes per token per layer / GPU bandwidth", "range": "[0, inf)"})
    t_row: int = field(default=128, metadata={"help": "output tile rows", "range": "[1, inf)"})
    t_col: int = field(default=128, metadata={"help": "output tile columns (tokens per column tile)",
                                              "range": "[1, inf)"})
    t_red: int = field(default=64, metadata={"help": "reduction tile depth", "range": "[1, inf)"})
    weight_floor: float = field(default=0.0, metadata={
        "help": "minimum batch time, s (weight read; not in the paper; 0 = off)", "range": "[0, inf)"})
    overhead: float = field(default=0.0, metadata={
        "help": "seconds added to every batch (not in the paper)", "range": "[0, inf)"})

    def __post_init__(self) -> None:
        for name in ("t_row", "t_col", "t_red"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"{name} must be a whole number >= 1, got {v!r}")
        for name in ("lin_tile_s", "nonlin_token_s", "pair_tile_s", "decode_attn_token_s", "weight_floor",
                     "overhead"):
            v = getattr(self, name)
            if v is None and name == "decode_attn_token_s":
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float, np.number)) or not 0 <= v < math.inf:
                raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")
        if not self.lin_tile_s + self.nonlin_token_s + self.weight_floor + self.overhead > 0:
            raise ValueError("lin_tile_s, nonlin_token_s, weight_floor and overhead are all 0: "
                             "a batch of decodes would take no time")
        m = self.model
        if self.decode_attn_token_s is None:
            object.__setattr__(self, "decode_attn_token_s",
                               2 * m.kv_heads * m.head_dim * m.dtype_bytes / self.gpu.bandwidth)
        for name in ("t_row", "t_col", "t_red"):
            object.__setattr__(self, name, int(getattr(self, name)))
        d = m.heads * m.head_dim
        for name in ("t_row", "t_red"):
            if d % getattr(self, name):
                raise ValueError(f"{name}={getattr(self, name)} does not divide d = heads x head_dim = {d} of "
                                 f"{m.name}: eq. (6) assumes model dimensions divisible by the tiles (section 3.2.1)")
        object.__setattr__(self, "_layers", m.layers)
        object.__setattr__(self, "_d", d)

    @property
    def t_lcm(self) -> int:
        """LCM(t_row, t_col, t_red): the chunk size RAD schedules (rad-slai.txt section 4.2)."""
        return math.lcm(self.t_row, self.t_col, self.t_red)

    # -- eq. (7), term by term --------------------------------------------------------------
    def chunk_attention_tiles(self, p, c):
        """Tile products of one prefill chunk's self-attention in one layer, eq. (6) without
        N / (s mu): ceil((p+c)/t_row) ceil(c/t_col) d/t_red + d/t_row ceil(c/t_col) ceil((p+c)/t_red).
        p, c may be numpy arrays (fractional means on the aggregate path)."""
        d, ctx, cols = self._d, p + c, -(-c // self.t_col)
        return -(-ctx // self.t_row) * cols * (d / self.t_red) + (d / self.t_row) * cols * -(-ctx // self.t_red)

    def components(self, shape: BatchShape):
        """eq. (7)'s four terms before their coefficients: (column tiles ceil(tau/t_col),
        tokens tau, decode context tokens x layers, prefill attention tile products x layers),
        so T_B = lin_tile_s a + nonlin_token_s b + decode_attn_token_s c + pair_tile_s e."""
        tau = shape.prefill_tokens + shape.decode_seqs
        tiles = -(-tau // self.t_col)
        decode = self._layers * shape.decode_ctx
        if len(shape.chunks):
            attn = self._layers * sum(self.chunk_attention_tiles(p, c) for p, c in shape.chunks)
        elif np.ndim(shape.prefill_seqs) == 0:
            k = shape.prefill_seqs
            attn = 0.0 if k == 0 else self._layers * k * self.chunk_attention_tiles(
                (shape.prefill_ctx - shape.prefill_tokens) / k, shape.prefill_tokens / k)
        else:       # arrays of batches: equal chunks per batch (see the class docstring)
            k = np.asarray(shape.prefill_seqs, dtype=float)
            safe = np.where(k > 0, k, 1.0)
            per = self.chunk_attention_tiles((np.asarray(shape.prefill_ctx, dtype=float)
                                              - np.asarray(shape.prefill_tokens, dtype=float)) / safe,
                                             np.asarray(shape.prefill_tokens, dtype=float) / safe)
            attn = np.where(k > 0, self._layers * k * per, 0.0)
        return tiles, tau, decode, attn

    def compute_time(self, shape: BatchShape):
        """T_B of eq. (7), without weight_floor and overhead."""
        tiles, tau, decode, attn = self.components(shape)
        return (self.lin_tile_s * tiles + self.nonlin_token_s * tau + self.decode_attn_token_s * decode
                + self.pair_tile_s * attn)

    def time(self, shape: BatchShape):
        """overhead + max(eq. (7), weight_floor)."""
        t = self.compute_time(shape)
        if self.weight_floor > 0:
            t = np.maximum(t, self.weight_floor) if isinstance(t, np.ndarray) else max(t, self.weight_floor)
        return self.overhead + t

    # -- helpers for Theorem 1 --------------------------------------------------------------
    def prefill_chunks(self, prompt: int, chunk: int | None = None) -> list[tuple[int, int]]:
        """(p, c) of a prompt prefilled alone in chunks of `chunk` (default t_lcm, as RAD does,
        Algorithm 1 line 13), the last one smaller when prompt is not a multiple."""
        chunk = self.t_lcm if chunk is None else chunk
        return [(p, min(chunk, prompt - p)) for p in range(0, prompt, chunk)]

    def prefill_time_per_request(self, prompt, *, floor_and_overhead: bool = False):
        """eq. (7) time of a perfectly tiled prefill of `prompt` tokens run alone, in chunks of
        t_lcm (last chunk smaller): sum over its chunks of the linear (eq. 4), non-linear (3.2.3)
        and prefill attention (eq. 6) terms. With floor_and_overhead, each chunk's batch also
        gets max(., weight_floor) + overhead. `prompt` may be an int or an array of ints."""
        if np.ndim(prompt):
            return np.array([self.prefill_time_per_request(int(x), floor_and_overhead=floor_and_overhead)
                             for x in np.asarray(prompt).ravel()]).reshape(np.shape(prompt))
        prompt = int(prompt)
        if prompt < 0:
            raise ValueError(f"prompt must be >= 0 tokens, got {prompt}")
        one = self.time if floor_and_overhead else self.compute_time
        return float(sum(one(BatchShape(prefill_tokens=c, prefill_seqs=1, prefill_attn=c * (p + (c + 1) / 2),
                                        prefill_ctx=p + c, chunks=[(p, c)]))
                         for p, c in self.prefill_chunks(prompt)))

    def theorem1_terms(self) -> dict[str, float | int]:
        """Coefficients of Theorem 1's T^R (rad-slai.txt, line ~290):

            T^R = linear_per_token E[L^P + L^D] + nonlinear_per_token E[L^P + L^D]
                + decode_attn_per_token E[sum_{i=1}^{L^D} (L^P + i)]
                + prefill_attn_per_pair E[L^P (L^P + t_lcm)]

        linear_per_token = lin_tile_s / t_col assumes full column tiles: every token, prefill or
        decode, shares a column tile with t_col - 1 others (RAD's t_col-decode batches and
        t_lcm chunks). decode_attn_per_token = N decode_attn_token_s, i.e. N T^{D,SA}(j) with
        T^{D,SA}(j) = decode_attn_token_s j (no ceilings, as in the batch model).
        prefill_attn_per_pair = N d pair_tile_s / (t_row t_col t_red)."""
        n = self._layers
        return {"linear_per_token": self.lin_tile_s / self.t_col,
                "nonlinear_per_token": self.nonlin_token_s,
                "decode_attn_per_token": n * self.decode_attn_token_s,
                "prefill_attn_per_pair": n * self._d * self.pair_tile_s / (self.t_row * self.t_col * self.t_red),
                "t_lcm": self.t_lcm}

    def decode_attention_time(self, context):
        """N T^{D,SA}(context) = N decode_attn_token_s context: one decode's attention over
        `context` tokens in all layers (eq. 5 without ceilings)."""
        return self._layers * self.decode_attn_token_s * (np.asarray(context, dtype=float) if np.ndim(context)
                                                           else context)

    def mean_request_time(self, prompts, decode_iters) -> float:
        """T^R of Theorem 1 (rad-slai.txt, line ~290) with expectations over equally weighted
        samples of L^P (`prompts`) and L^D (`decode_iters`), T^{D,SA}(j) = decode_attn_token_s j:

            T^R = lin_tile_s E[L^P + L^D] / t_col + nonlin_token_s E[L^P + L^D]
                + N decode_attn_token_s E[L^D L^P + L^D (L^D + 1) / 2]
                + N d pair_tile_s / (t_row t_col t_red) E[L^P (L^P + t_lcm)]

        (sum_{i=1}^{L^D} (L^P + i) = L^D L^P + L^D (L^D + 1) / 2). The first term assumes full
        column tiles (see theorem1_terms). L^D counts decode iterations after the first output
        token (which the last prefill chunk yields): a kvsched request with o output tokens has
        L^D = o - 1; convert before calling."""
        lp = np.asarray(prompts, dtype=float).ravel()
        ld = np.asarray(decode_iters, dtype=float).ravel()
        if lp.shape != ld.shape or lp.size == 0:
            raise ValueError(f"prompts and decode_iters must be equal-length non-empty samples, "
                             f"got {lp.size} and {ld.size}")
        k = self.theorem1_terms()
        tokens = float(np.mean(lp + ld))
        return (k["linear_per_token"] * tokens + k["nonlinear_per_token"] * tokens
                + k["decode_attn_per_token"] * float(np.mean(ld * lp + ld * (ld + 1) / 2))
                + k["prefill_attn_per_pair"] * float(np.mean(lp * (lp + k["t_lcm"]))))


# Fitted by benchmarks/fit_tiled.py (the values it prints, rounded to 4 significant digits) to
# the authors' measurements of a lone 2048-token prompt under Sarathi-Serve, chunk budgets
# 64-1024, Mistral-7B-Instruct-v0.2 on an RTX 6000 Ada (docs/rad-slai.md): both the median TTFT
# and the mean batch time, each run modelled as its chunks plus one decode batch (the two
# columns agree only so: the extra batch they imply is 20-26 ms at every budget, one decode
# step). Joint least squares on both columns' relative errors; max |error| 3.5% on the batch
# times and 4.9% on TTFT. weight_floor is the catalogue's weight read, 14.48e9 B / 0.96e12 B/s,
# not fitted. nonlin_token_s is not separable from lin_tile_s on this table (every chunk above
# the floor is whole 128-token tiles) and is given to the GEMMs. decode_attn_token_s is not
# identifiable from these batches: it is the catalogue's KV read time per token per layer,
# 2 * 8 * 128 * 2 B / 0.96e12 B/s.
MISTRAL_7B_RTX_6000_ADA = dict(lin_tile_s=0.01032, nonlin_token_s=0.0, pair_tile_s=2.325e-08,
                               decode_attn_token_s=4.267e-09, weight_floor=0.01509, overhead=0.00822)

TILED_PRESETS = {"tiled-mistral-7b-rtx-6000-ada": MISTRAL_7B_RTX_6000_ADA}
