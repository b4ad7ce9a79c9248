"""`pnmix tune MODEL --bits B`: the pn-mix config with the lowest KL against full precision whose
measured bits per K/V element are at most B, on a calibration text (docs/EVAL.md, "pnmix tune").

One prefill and one full-precision reference run (kl.Teacher, kl.teacher_forced) serve every
candidate: a candidate is a pnmix Method with its config fields, handed the prefill, decoded and
scored exactly as `pnmix eval` does (kl.score; its bytes by kv_bytes). The pn-mix presets of
methods.METHODS are measured first: they are points of the front and the search starts from the
best of them within the budget.

The search is coordinate descent over KNOBS. Each sweep screens neighbours of the current config
(one knob one step, or one knob a step up and another a step down: a trade that keeps the bytes near
the budget), those that use the most of the budget first, on the first quarter of the decode
steps; the best screened neighbours are decoded in full and the best full result becomes the
current config. When every neighbour within the budget has been tried, the neighbours' neighbours
are (MAX_RADIUS): at the budget most single moves do not fit. A neighbour's bits are known before it runs (format.CacheLayout's byte count), so
no decode is spent on a config over the budget. The budget counts decode steps: --budget-evals K
full evaluations' worth (a screen is a quarter of one), the presets besides.
"""

from __future__ import annotations

import dataclasses
import io
import itertools
import json
import math
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ...config import PnMixConfig
from ...errors import PnMixError
from ...format import CacheLayout
from ...io import JsonReport, check_output_path, write_bytes_atomic
from ..models import ModelDims
from .inputs import load_text_tokens, read_text
from .kl import Teacher, check_scores, score, teacher_forced
from .methods import METHODS, REFERENCE, Method, pnmix_config
from .report import require_matplotlib

# The knobs the search moves, and the values each may take in order (a step goes to the next value).
# pair_layout is not one: it is the model's RoPE, not a choice. value_group_size above head_dim is
# head_dim (one block per head), and a value the model's head_dim refuses is left out.
KNOBS: Dict[str, Tuple[Any, ...]] = {
    "value_bits": (1, 2, 3, 4, 5, 6, 8),
    "key_high_bits": (1, 2, 3, 4, 5, 6, 8),
    "key_low_bits": (1, 2, 3, 4, 5, 6),
    "high_ratio": (0.125, 0.25, 0.375, 0.5, 0.625, 0.75, 0.875),
    "group_size": (32, 64, 128, 256),
    "value_group_size": (16, 32, 64, 128),
    "residual_size": (32, 64, 128, 256),
    "sink_tokens": (0, 8, 16, 32, 64, 128),
}
SCREENS_PER_SWEEP = 6  # neighbours screened per sweep
CONFIRMS_PER_SWEEP = 2  # of those, decoded in full when they beat the current config on the screen
MAX_RADIUS = 2  # neighbour moves: when every neighbour is tried, the neighbours' neighbours
PRESETS = tuple(name for name, m in METHODS.items() if m.cache == "pnmix")


@dataclasses.dataclass
class Candidate:
    """A measured config: ``steps`` decode steps, ``kl`` over them (bits and bytes: full runs only)."""

    config: PnMixConfig
    bits_predicted: float
    steps: int
    kl: float
    perplexity: float
    top1: float
    bytes: int
    bits_per_element: float
    screen_kl: float  # KL over the screen's first steps (a full run's first steps are a screen)
    preset: Optional[str] = None

    @property
    def name(self) -> str:
        return self.preset or describe(self.config)

    def row(self) -> Dict[str, Any]:
        return {"name": self.name, "preset": self.preset, "config": knob_fields(self.config),
                "bits_per_element": self.bits_per_element, "bits_predicted": self.bits_predicted,
                "bytes": self.bytes, "kl": self.kl,
                "perplexity": self.perplexity, "top1": self.top1, "steps": self.steps}


def knob_fields(config: PnMixConfig) -> Dict[str, Any]:
    """The config file's fields: every knob (pair_layout is the model's, resolved where it is read)."""
    return {name: getattr(config, name) for name in KNOBS}


def describe(config: PnMixConfig) -> str:
    c = config
    keys = (f"k{c.key_high_bits}" if c.key_high_bits == c.key_low_bits
            else f"k{c.key_high_bits}/{c.key_low_bits}@{c.high_ratio:g}")
    return f"{keys} v{c.value_bits} g{c.group_size} vg{c.value_group_size} r{c.residual_size} s{c.sink_tokens}"


# ---- the search space ---------------------------------------------------------------------------
class Space:
    """The valid configs of one model at one length and their bits per element, before any decode."""

    def __init__(self, model_config: Any, tokens: int):
        self.model_config = model_config
        self.dims = ModelDims.from_config(model_config)
        self.tokens = tokens
        self.base = pnmix_config(METHODS["pnmix"], model_config)

    def canonical(self, fields: Dict[str, Any]) -> Optional[PnMixConfig]:
        """The config, in one form per distinct cache (value groups cut to head_dim, uniform keys at
        ratio 0.5), or None where the config rules or the search's own rule refuse it: the high
        pairs (the most energy) never get fewer bits than the low ones."""
        fields = dict(fields)
        fields["value_group_size"] = min(fields["value_group_size"], self.dims.head_dim)
        try:
            config = self.base.replace(**fields)
            config.check_head_dim(self.dims.head_dim)
        except PnMixError:
            return None
        if config.key_high_bits < config.key_low_bits:
            return None
        high = config.high_pairs(self.dims.head_dim)
        if high == 0 or high == self.dims.head_dim // 2 or config.key_high_bits == config.key_low_bits:
            bits = config.key_low_bits if high == 0 else config.key_high_bits
            config = config.replace(key_high_bits=bits, key_low_bits=bits, high_ratio=0.5)
        return config

    def bits(self, config: PnMixConfig) -> float:
        """Bits per element the cache will hold: format.CacheLayout's persistent bytes, every layer."""
        layout = CacheLayout(config, 1, self.dims.kv_heads, self.dims.head_dim, self.tokens)
        per_layer = layout.persistent_bytes(self.tokens)["persistent_cache_bytes"]
        return 8 * self.dims.layers * per_layer / self.dims.kv_bytes(self.tokens, 1)

    def neighbours(self, config: PnMixConfig) -> List[PnMixConfig]:
        """One knob one step either way, or one knob a step up and another a step down."""
        moves: List[Tuple[Tuple[str, int], ...]] = [((knob, d),) for knob in KNOBS for d in (1, -1)]
        moves += [((up, 1), (down, -1)) for up, down in itertools.permutations(KNOBS, 2)]
        found: Dict[Tuple, PnMixConfig] = {}
        config = self.canonical(knob_fields(config)) or config  # a preset's config may not be canonical
        for move in moves:
            fields = knob_fields(config)
            for knob, direction in move:
                value = step(KNOBS[knob], fields[knob], direction)
                if value is None:
                    break
                fields[knob] = value
                if knob == "group_size":  # a larger group needs its residual: it follows
                    fields["residual_size"] = max(fields["residual_size"], value)
            else:
                moved = self.canonical(fields)
                if moved is not None and moved != config:
                    found.setdefault(key(moved), moved)
        return list(found.values())

    def around(self, config: PnMixConfig, radius: int) -> List[PnMixConfig]:
        """The configs up to ``radius`` neighbour moves away (1: the neighbours; 2: theirs too, so
        that a config at the budget can reach one behind two trades)."""
        found = {key(n): n for n in self.neighbours(config)}
        for _ in range(radius - 1):
            for n in list(found.values()):
                for m in self.neighbours(n):
                    found.setdefault(key(m), m)
        found.pop(key(self.canonical(knob_fields(config)) or config), None)
        return list(found.values())

    def lowest(self) -> Tuple[float, PnMixConfig]:
        """The fewest bits any config of KNOBS reaches: bits grow with every knob but group_size,
        whose scales fall as its residual grows, so the lowest is one of the groups' 1-bit configs."""
        found = []
        for group in KNOBS["group_size"]:
            config = self.canonical({"value_bits": 1, "key_high_bits": 1, "key_low_bits": 1, "high_ratio": 0.5,
                                     "group_size": group, "value_group_size": max(KNOBS["value_group_size"]),
                                     "residual_size": group, "sink_tokens": 0})
            if config is not None:
                found.append((self.bits(config), config))
        if not found:
            raise PnMixError(f"no config of the search space is valid for head_dim {self.dims.head_dim}")
        return min(found, key=lambda f: f[0])


def step(values: Sequence[Any], current: Any, direction: int) -> Any:
    """The next value of a knob's list above (direction 1) or below (-1) current, or None."""
    above = [v for v in values if v > current]
    below = [v for v in values if v < current]
    if direction > 0:
        return min(above) if above else None
    return max(below) if below else None


def key(config: PnMixConfig) -> Tuple:
    return tuple(knob_fields(config).values())


# ---- the search -----------------------------------------------------------------------------------
class Tuner:
    """Candidates scored against one reference run; ``spent``: decode steps so far (presets aside)."""

    def __init__(self, model, teacher: Teacher, space: Space, budget_bits: float, budget_steps: int,
                 progress: Callable[[str], None]):
        self.model, self.teacher, self.space = model, teacher, space
        self.budget_bits, self.budget_steps = budget_bits, budget_steps
        self.progress = progress
        self.steps = len(teacher.fed)
        self.screen_steps = max(1, self.steps // 4)
        self.spent = 0
        self.full: Dict[Tuple, Candidate] = {}
        self.screened: Dict[Tuple, Candidate] = {}
        self.reference = teacher_forced(model, METHODS[REFERENCE], teacher.prefill, teacher.fed)

    def measure(self, config: PnMixConfig, steps: int, preset: Optional[str] = None) -> Candidate:
        method = Method(preset or describe(config), "pnmix", "a tuning candidate", knob_fields(config))
        run = teacher_forced(self.model, method, self.teacher.prefill, self.teacher.fed[:steps])
        figures = score(run, self.reference.first(steps), self.teacher.targets[:steps])
        check_scores(self.model, figures, f"config {method.name}")
        first = self.screen_steps
        screen = score(run.first(first), self.reference.first(first), self.teacher.targets[:first])["kl"]
        candidate = Candidate(config, self.space.bits(config), steps, figures["kl"], figures["perplexity"],
                              figures["top1"], run.bytes, self.teacher.bits_per_element(run.bytes), screen, preset)
        if preset is None:
            self.spent += steps
        (self.full if steps == self.steps else self.screened)[key(config)] = candidate
        kind = "preset" if preset else ("full" if steps == self.steps else f"screen, {steps} steps")
        self.progress(f"tune {self.spent}/{self.budget_steps} steps: {candidate.name} ({kind}): "
                      f"{candidate.bits_predicted:.3f} bits/element, KL {candidate.kl:.4g}")
        return candidate

    def affords(self, steps: int) -> bool:
        return self.spent + steps <= self.budget_steps

    def search(self) -> Candidate:
        presets = [self.measure(pnmix_config(METHODS[name], self.space.model_config), self.steps, name)
                   for name in PRESETS]
        within = [c for c in presets if c.bits_per_element <= self.budget_bits]
        current = min(within, key=lambda c: c.kl) if within else self.descend()
        if current is None:
            return self.winner()
        tried = {key(self.space.canonical(knob_fields(c.config)) or c.config) for c in self.full.values()}
        radius = 1
        while True:
            fresh = [n for n in self.space.around(current.config, radius)
                     if key(n) not in tried and self.space.bits(n) <= self.budget_bits]
            if not fresh and radius < MAX_RADIUS:  # every neighbour tried: look one move further
                radius += 1
                self.progress(f"tune: every neighbour of {current.name} tried; now {radius} moves away")
                continue
            if not fresh:
                self.progress(f"tune: no untried config within {radius} moves of {current.name} and the budget: done")
                break
            fresh.sort(key=lambda n: (-self.space.bits(n), describe(n)))
            batch = fresh[:SCREENS_PER_SWEEP]
            screens = []
            for config in batch:
                if not self.affords(self.screen_steps):
                    break
                tried.add(key(config))
                screens.append(self.measure(config, self.screen_steps))
            better = sorted((c for c in screens if c.kl < current.screen_kl), key=lambda c: c.kl)
            moved = False
            for screen in better[:CONFIRMS_PER_SWEEP]:
                if not self.affords(self.steps):
                    break
                full = self.measure(screen.config, self.steps)
                if full.bits_per_element <= self.budget_bits and full.kl < current.kl:
                    current, moved = full, True
            if moved:
                radius = 1
                self.progress(f"tune: now at {current.name}, KL {current.kl:.4g}")
            if not self.affords(self.screen_steps) or (better and not self.affords(self.steps)):
                self.progress("tune: the budget of decode steps is spent")
                break
        return self.winner()

    def descend(self) -> Optional[Candidate]:
        """No preset fits: from the manifest's config, steps down (the least bits lost that reaches the
        budget, else the most bits dropped) until the config fits, then its full run."""
        config = self.space.base
        for _ in range(64):
            if self.space.bits(config) <= self.budget_bits:
                break
            downs = [n for n in self.space.neighbours(config) if self.space.bits(n) < self.space.bits(config)]
            if not downs:
                break
            fits = [n for n in downs if self.space.bits(n) <= self.budget_bits]
            config = (max(fits, key=self.space.bits) if fits else min(downs, key=self.space.bits))
        if self.space.bits(config) > self.budget_bits or not self.affords(self.steps):
            return None
        return self.measure(config, self.steps)

    def winner(self) -> Candidate:
        fits = [c for c in self.full.values() if c.bits_per_element <= self.budget_bits]
        if not fits:
            raise PnMixError(f"no config measured within --bits {self.budget_bits:g}: raise --budget-evals "
                             f"(the budget of {self.budget_steps} decode steps ran out)")
        return min(fits, key=lambda c: (c.kl, c.bits_per_element))


def pareto_front(candidates: Sequence[Candidate]) -> List[Candidate]:
    """The candidates no other beats on both bits and KL, by bits."""
    front: List[Candidate] = []
    for c in sorted(candidates, key=lambda c: (c.bits_per_element, c.kl)):
        if not front or c.kl < front[-1].kl:
            front.append(c)
    return front


# ---- the command ----------------------------------------------------------------------------------
def tune_command(model: str, bits: float, context: int, decode_tokens: int, text: Optional[Path],
                 budget_evals: int, dtype: str, json_path: Optional[Path], config_out: Optional[Path],
                 plot: Optional[Path]) -> int:
    from ..attention import register
    from ..models import load_causal_lm, load_model_config, resolve_model
    from .command import _progress, check_positions

    if not math.isfinite(bits) or bits <= 0:
        raise PnMixError(f"--bits must be a positive number of bits per element, got {bits:g}")
    for option, value in (("--context", context), ("--decode-tokens", decode_tokens), ("--budget-evals", budget_evals)):
        if value < 1:
            raise PnMixError(f"{option} must be at least 1, got {value}")
    report_file = JsonReport(json_path)  # every output checked before the (long) run
    if config_out is not None:
        check_output_path(config_out)
    if plot is not None:
        check_output_path(plot)
        require_matplotlib()
    source_text = read_text(text)
    source = resolve_model(model)
    model_config = load_model_config(source)
    check_positions(model_config, source.name, [context], decode_tokens, [])
    space = Space(model_config, context + decode_tokens)
    lowest, config = space.lowest()
    if bits < lowest:
        raise PnMixError(f"--bits {bits:g} is below what any pn-mix config reaches on {source.name} at {context} + "
                         f"{decode_tokens} tokens: {lowest:.3f} bits per element ({describe(config)})")
    tokens = load_text_tokens(source, model_config)
    ids = tokens.encode(source_text)
    if len(ids) < context + decode_tokens + 1:
        raise PnMixError(f"the text has {len(ids)} tokens ({tokens.name}); --context {context} + --decode-tokens "
                         f"{decode_tokens} needs {context + decode_tokens + 1}")
    register()
    lm = load_causal_lm(source, dtype, model_config=model_config)
    progress = _progress()
    start = time.perf_counter()
    id_tensor = torch.tensor([ids[:context + decode_tokens + 1]], dtype=torch.long, device=lm.device)
    teacher = Teacher.run(lm, id_tensor, context, decode_tokens)
    tuner = Tuner(lm, teacher, space, bits, budget_evals * decode_tokens, progress)
    winner = tuner.search()
    measured = list(tuner.full.values())
    front = pareto_front(measured)
    report = {"model": source.name, "text": str(text) if text is not None else "hamlet", "context": context,
              "decode_tokens": decode_tokens, "bits_budget": bits, "budget_evals": budget_evals,
              "decode_steps_spent": tuner.spent, "seconds": time.perf_counter() - start,
              "winner": winner.row(), "front": [c.row() for c in front],
              "evaluated": [dict(c.row(), on_front=c in front) for c in measured],
              "screened": [{field: c.row()[field] for field in ("name", "config", "bits_predicted", "steps", "kl")}
                           for c in tuner.screened.values()]}  # KL over the first steps only
    print_front(report)
    report_file.write(report)
    if config_out is not None:
        write_bytes_atomic(config_out, (json.dumps(winner.row()["config"], indent=2) + "\n").encode())
    if plot is not None:
        write_bytes_atomic(plot, render_front(report))
    return 0


def print_front(report: Dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{report['model']}: pn-mix configs at {report['context']} + {report['decode_tokens']} "
                        f"tokens, KL vs {REFERENCE} (budget {report['bits_budget']:g} bits/element)")
    for column in ("config", "preset", "bits/elem", "KL", "perplexity", "top-1", "front"):
        table.add_column(column, justify="left" if column in ("config", "preset") else "right")
    winner = report["winner"]["config"]
    for row in sorted(report["evaluated"], key=lambda r: r["bits_per_element"]):
        mark = "winner" if row["config"] == winner else ("yes" if row["on_front"] else "")
        table.add_row(describe(PnMixConfig(**row["config"])), row["preset"] or "", f"{row['bits_per_element']:.3f}",
                      f"{row['kl']:.4f}", f"{row['perplexity']:.3f}", f"{row['top1']:.3f}", mark)
    console = Console(width=140)
    console.print(table)
    console.print(f"winner: {report['winner']['name']} at {report['winner']['bits_per_element']:.3f} bits/element, "
                  f"KL {report['winner']['kl']:.4g} ({report['decode_steps_spent']} decode steps searched)",
                  soft_wrap=True, highlight=False)


def render_front(report: Dict[str, Any]) -> bytes:
    """PNG: every full evaluation's KL (log) against its bits, the front, the presets and the winner."""
    require_matplotlib()
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 5))
    rows = report["evaluated"]
    ax.scatter([r["bits_per_element"] for r in rows], [max(r["kl"], 1e-6) for r in rows], color="0.7", s=18,
               label="evaluated configs")
    front = report["front"]
    ax.plot([r["bits_per_element"] for r in front], [max(r["kl"], 1e-6) for r in front], "-o", color="tab:blue",
            ms=4, label="Pareto front")
    for r in (r for r in rows if r["preset"]):
        ax.scatter(r["bits_per_element"], max(r["kl"], 1e-6), marker="s", s=50, color="tab:orange")
        ax.annotate(r["preset"], (r["bits_per_element"], max(r["kl"], 1e-6)), fontsize=8, xytext=(4, 3),
                    textcoords="offset points")
    win = report["winner"]
    ax.scatter(win["bits_per_element"], max(win["kl"], 1e-6), marker="*", s=260, color="tab:red", zorder=5,
               label=f"winner: {win['name']}")
    ax.axvline(report["bits_budget"], color="tab:red", ls="--", lw=1, label=f"budget {report['bits_budget']:g} bits")
    ax.set_yscale("log")
    ax.set_xlabel("bits per K/V element (measured bytes)")
    ax.set_ylabel(f"mean KL(p_{REFERENCE} || p)  (lower is better)")
    ax.set_title(f"{report['model']}: pnmix tune at {report['context']} + {report['decode_tokens']} tokens")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    plt.close(fig)
    return buffer.getvalue()
