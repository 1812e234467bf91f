"""Read a compiled program's optimized HLO text (`jax.jit(f).lower(...).compile().as_text()`) for
where XLA:GPU blocks the host and how many HBM bytes one execution moves.

`host_sync_points`: each `conditional` (XLA:GPU copies the predicate to the host and waits) and
each `while` without a `known_trip_count` in its backend_config (the host reads the condition
every iteration). `while_loops` lists every while, with its trip count when XLA knows it. A cheap
`lax.cond` is often rewritten into a `select` (both branches computed), which is no sync and is
not reported. (A while or conditional that XLA captures in a CUDA-graph command buffer with
conditional nodes would not sync either; the text does not say, so they are reported.)

`modeled_bytes` is a model, not a measurement: each kernel-like instruction executed (fusions,
custom-calls, copies, collectives, unfused compute) reads its operands and writes its result once
from/to HBM. In-place dynamic-update-slices and scatters (top level or a fusion's root) count the
update, not the buffer; a fusion operand read only through dynamic-slice/slice/gather counts the
slices. While bodies count x the known trip count (x1 and flagged when unknown), a conditional its
largest branch. It misses L2/cache reuse, re-reads and recomputation inside a kernel, the old
values a combining scatter (scatter-add) reads, and what a custom-call really touches: a
paged-attention kernel reading only the KV blocks its page table names is counted as reading its
whole KV operand; `custom_call_bytes` overrides those. A cuBLAS call's workspace (the s8 last element of its
result) is scratch and not counted.
"""

from __future__ import annotations

import dataclasses
import functools
import re

_DTYPE_BYTES = {"pred": 1, "bf16": 2, "f16": 2, "f32": 4, "f64": 8, "c64": 8, "c128": 16, "token": 0}
_SHAPE_RE = re.compile(r"\b([a-z]\w*)\[([^\]]*)\]")
_COMMENT_RE = re.compile(r"/\*.*?\*/")
_HEADER_RE = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*(\(.*)?\{\s*$")
_INST_RE = re.compile(r"^(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_COMP_ATTRS = ("calls", "condition", "body", "to_apply", "true_computation", "false_computation",
               "branch_computations")
# Instructions that launch no kernel and move no bytes of their own
_FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "partition-id",
         "replica-id", "add-dependency", "optimization-barrier", "domain", "while", "conditional", "call",
         "async-start", "async-update", "async-done"}
_COLLECTIVES = {"all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute",
                "collective-broadcast", "ragged-all-to-all"}
_SLICING = {"dynamic-slice", "slice", "gather"}
# A cuBLAS call's result is (outputs..., s8[N] workspace): scratch it may barely touch, not output
_WORKSPACE_RE = re.compile(r",\s*s8\[\d+\](\{[^}]*\})?\s*\)\s*$")


def dtype_bytes(dtype: str) -> float:
    """Bytes of one element of an HLO primitive type (0 for tokens and unknown types)."""
    bits = re.match(r"[suf](\d+)", dtype)  # s4, u32, f8e4m3fn, f4e2m1fn: the width follows the letter
    return _DTYPE_BYTES.get(dtype, int(bits.group(1)) / 8 if bits else 0)


def dims(shape: str) -> tuple[int, ...]:
    """The dimensions of an array shape string ("bf16[32,4096]{1,0}" -> (32, 4096))."""
    m = _SHAPE_RE.search(_COMMENT_RE.sub("", shape))
    return tuple(int(d) for d in m.group(2).replace("<=", "").split(",") if d.strip().isdigit()) if m else ()


def shape_bytes(shape: str) -> float:
    """Bytes of an HLO shape string, tuples summed; layouts, tiling and comments ignored."""
    total = 0.0
    for dtype, dims in _SHAPE_RE.findall(_COMMENT_RE.sub("", shape)):
        n = 1
        for d in dims.replace("<=", "").split(","):
            n *= int(d) if d.strip().isdigit() else 1
        total += n * dtype_bytes(dtype)
    return total


@dataclasses.dataclass
class Instruction:
    """One HLO instruction. operands: (inline shape or None, name) each."""
    name: str
    shape: str
    opcode: str
    operands: list
    attrs: str
    is_root: bool = False

    def called(self, attr: str) -> list[str]:
        m = re.search(rf"\b{attr}=(\{{[^}}]*\}}|%?[\w.\-]+)", self.attrs)
        return re.findall(r"[\w.\-]+", m.group(1).replace("%", " ")) if m else []

    def meta(self, key: str) -> str | None:
        m = re.search(rf'\b{key}=("(?:[^"\\]|\\.)*"|\d+)', self.attrs)
        return None if m is None else m.group(1).strip('"')


@dataclasses.dataclass
class Computation:
    name: str
    instructions: list
    is_entry: bool = False

    def __post_init__(self):
        self.by_name = {i.name: i for i in self.instructions}

    def operand_shape(self, inst: Instruction, k: int) -> str:
        shape, name = inst.operands[k]
        if shape is None and name in self.by_name:
            shape = self.by_name[name].shape
        return shape or ""

    def operand_bytes(self, inst: Instruction, k: int) -> float:
        return shape_bytes(self.operand_shape(inst, k))

    @functools.cached_property
    def users(self) -> dict[str, list]:
        """name -> [(instruction using it, operand position)]"""
        out: dict[str, list] = {}
        for inst in self.instructions:
            for k, (_, name) in enumerate(inst.operands):
                out.setdefault(name, []).append((inst, k))
        return out


@dataclasses.dataclass
class HloModule:
    computations: dict
    entry: str | None
    source_lines: dict  # stack_frame_id -> "file:line"

    def source(self, inst: Instruction) -> str | None:
        if inst.meta("source_file") and inst.meta("source_line"):
            return f"{inst.meta('source_file')}:{inst.meta('source_line')}"
        return self.source_lines.get(inst.meta("stack_frame_id"))


def _close(s: str, i: int) -> int:
    """Index just past the bracket matching s[i], skipping quoted strings (len(s) if none)."""
    depth, quoted = 0, False
    for j in range(i, len(s)):
        c = s[j]
        if c == '"' and s[j - 1] != "\\":
            quoted = not quoted
        elif not quoted and c in "([{":
            depth += 1
        elif not quoted and c in ")]}":
            depth -= 1
            if depth == 0:
                return j + 1
    return len(s)


def _split_top(s: str) -> list[str]:
    parts, depth, start = [], 0, 0
    for j, c in enumerate(s):
        depth += c in "([{"
        depth -= c in ")]}"
        if c == "," and depth == 0:
            parts.append(s[start:j])
            start = j + 1
    return [p.strip() for p in [*parts, s[start:]] if p.strip()]


def _parse_instruction(line: str) -> Instruction | None:
    m = _INST_RE.match(_COMMENT_RE.sub("", line.strip()))
    if not m:
        return None
    rest = m.group(3)
    end = _close(rest, 0) if rest.startswith("(") else rest.find(" ")
    op = re.match(r"\s*([a-z][\w\-]*)\(", rest[end:]) if end > 0 else None
    if op is None:
        return None
    open_at = end + op.end() - 1
    close_at = _close(rest, open_at)
    operands = []
    for text in _split_top(rest[open_at + 1:close_at - 1]):
        ref = re.search(r"%?([\w.\-]+)$", text)
        if ref and (text.split()[-1].startswith("%") or " " not in text):
            shape = text[:ref.start()].strip() or None
            operands.append((shape, ref.group(1)))
    return Instruction(m.group(2), rest[:end], op.group(1), operands, rest[close_at:], bool(m.group(1)))


def _source_lines(lines: list[str]) -> dict:
    """stack_frame_id -> "file:line", from the FileNames/FileLocations/StackFrames tables newer XLA
    prints instead of source_file/source_line in each instruction's metadata."""
    tables: dict[str, dict] = {}
    section = None
    for line in map(str.strip, lines):
        m = re.match(r"^(\d+)\s+(.*)$", line)
        section = tables.setdefault(line, {}) if re.fullmatch(r"[A-Z]\w+", line) else section if m else None
        if m and section is not None:
            section[m.group(1)] = m.group(2)
    kv = lambda text, key: (re.findall(rf"\b{key}=(\d+)", text) or [""])[0]
    files, locs, out = tables.get("FileNames", {}), tables.get("FileLocations", {}), {}
    for frame, text in tables.get("StackFrames", {}).items():
        loc = locs.get(kv(text, "file_location_id"), "")
        if files.get(kv(loc, "file_name_id")) and kv(loc, "line"):
            out[frame] = f"{files[kv(loc, 'file_name_id')].strip(chr(34))}:{kv(loc, 'line')}"
    return out


def parse_hlo(text: str) -> HloModule:
    """Split HLO text into computations of instructions. Lines it cannot read are skipped."""
    lines = text.splitlines()
    comps: dict[str, Computation] = {}
    entry, current, insts = None, None, []
    for line in lines:
        if current is None:
            m = _HEADER_RE.match(line) if not line.startswith(("HloModule", " ", "\t")) else None
            if m:
                current, insts = (m.group(2), bool(m.group(1))), []
        elif line.strip() == "}":
            comps[current[0]] = Computation(current[0], insts, current[1])
            entry = current[0] if current[1] else entry
            current = None
        elif (inst := _parse_instruction(line)) is not None:
            insts.append(inst)
    if entry is None and comps:
        entry = list(comps)[-1]
    return HloModule(comps, entry, _source_lines(lines))


def _walk(module: HloModule, comp: str, seen: tuple = ()):
    """(computation, instruction) for each instruction executed from `comp`, into control flow."""
    if comp not in module.computations or comp in seen:
        return
    for inst in module.computations[comp].instructions:
        yield comp, inst
        if inst.opcode in ("while", "conditional", "call", "async-start"):
            for attr in _COMP_ATTRS:
                for callee in inst.called(attr):
                    yield from _walk(module, callee, (*seen, comp))


def _trip_count(inst: Instruction) -> int | None:
    m = re.search(r'"known_trip_count":\{"n":"?(\d+)', inst.attrs)
    return int(m.group(1)) if m else None


def _loop_point(module: HloModule, comp: str, inst: Instruction) -> dict:
    point = {"op": inst.opcode, "name": inst.name, "computation": comp, "op_name": inst.meta("op_name"),
             "source": module.source(inst)}
    if inst.opcode == "while":
        point["known_trip_count"] = _trip_count(inst)
    return point


def while_loops(hlo_text: str) -> list[dict]:
    """Every `while` executed, as `host_sync_points` entries; known_trip_count None: syncs per iteration."""
    module = parse_hlo(hlo_text)
    return [_loop_point(module, c, i) for c, i in _walk(module, module.entry) if i.opcode == "while"]


def host_sync_points(hlo_text: str) -> list[dict]:
    """Each conditional and each while without a known trip count executed from ENTRY: dicts of op,
    name, computation, known_trip_count (whiles), op_name and source ("file:line") or None."""
    module = parse_hlo(hlo_text)
    return [_loop_point(module, c, i) for c, i in _walk(module, module.entry)
            if i.opcode == "conditional" or (i.opcode == "while" and _trip_count(i) is None)]


def _in_place(inst: Instruction | None) -> tuple[list[int], list[int]]:
    """(buffer operands updated in place, update operands) of a dynamic-update-slice or scatter."""
    if inst is not None and inst.opcode == "dynamic-update-slice" and len(inst.operands) > 1:
        return [0], [1]
    if inst is not None and inst.opcode == "scatter" and len(inst.operands) >= 3:
        n = (len(inst.operands) - 1) // 2  # inputs..., indices, updates...
        return list(range(n)), list(range(n + 1, 2 * n + 1))
    return [], []


def result_bytes(inst: Instruction) -> float:
    """Bytes an instruction writes: its shape, less a cuBLAS call's workspace."""
    shape = _COMMENT_RE.sub("", inst.shape).strip()
    if inst.opcode == "custom-call" and (inst.meta("custom_call_target") or "").startswith("__cublas"):
        shape = _WORKSPACE_RE.sub(")", shape)
    return shape_bytes(shape)


def _fusion_bytes(inst: Instruction, comp: Computation, fused: Computation) -> float:
    users = fused.users

    def uses(name):  # the uses of a value, bitcasts and reshapes (free inside a fusion) looked through
        for user, k in users.get(name, []):
            yield from uses(user.name) if user.opcode in ("bitcast", "reshape") else [(user, k)]

    root = next((i for i in fused.instructions if i.is_root), fused.instructions[-1])
    outputs = [fused.by_name.get(n) for _, n in root.operands] if root.opcode == "tuple" else [root]
    written, in_place = 0.0, set()
    for out in outputs:
        while out is not None and out.opcode == "bitcast" and out.operands:
            out = fused.by_name.get(out.operands[0][1])
        buffers, updates = _in_place(out)
        if out is not None:
            written += sum(fused.operand_bytes(out, k) for k in updates) if updates else result_bytes(out)
            in_place |= {(out.name, k) for k in buffers}
    params = {i.operands[0][1]: i for i in fused.instructions if i.opcode == "parameter" and i.operands}
    read = 0.0
    for k in range(len(inst.operands)):
        full, param, part = comp.operand_bytes(inst, k), params.get(str(k)), 0.0
        for user, pos in uses(param.name) if param is not None else []:
            if (user.name, pos) in in_place:
                continue
            if user.opcode not in _SLICING or pos != 0:
                part = full
                break
            part += shape_bytes(user.shape)
        read += min(part, full) if param is not None else full
    return read + written


def _result_shape(inst: Instruction, comp: Computation) -> str:
    if inst.opcode.endswith("-start"):  # the start's shape holds its operands too; the done's is the result
        done = next((u for u, _ in comp.users.get(inst.name, []) if u.opcode.endswith("-done")), None)
        if done is not None:
            return done.shape
    return inst.shape


def _inst_bytes(inst: Instruction, comp: Computation, module: HloModule, overrides: dict) -> float:
    for key in (inst.name, inst.meta("custom_call_target")):
        if inst.opcode == "custom-call" and key in overrides:
            return float(overrides[key])
    fused = module.computations.get(next(iter(inst.called("calls")), ""))
    if inst.opcode in ("fusion", "fusion-start") and fused is not None and fused.instructions:
        return _fusion_bytes(inst, comp, fused)
    operands = [comp.operand_bytes(inst, k) for k in range(len(inst.operands))]
    buffers, updates = _in_place(inst)
    if updates:  # in place: reads the updates and indices, writes the updates
        return sum(b for k, b in enumerate(operands) if k not in buffers) + sum(operands[k] for k in updates)
    if inst.opcode in _SLICING:
        return shape_bytes(inst.shape) * 2 + sum(operands[1:])
    if inst.opcode == "custom-call":
        return sum(operands) + result_bytes(inst)
    return sum(operands) + shape_bytes(_result_shape(inst, comp))


class _Model:
    """Entries {(computation, name): {name, kind, bytes, count, dtype, result}} of one execution."""

    def __init__(self, module: HloModule, overrides: dict):
        self.module, self.overrides, self.unknown = module, overrides, set()

    def run(self, comp_name: str, mult: int, out: dict, seen: tuple = ()) -> dict:
        comp = self.module.computations.get(comp_name)
        if comp is None or comp_name in seen:
            return out
        seen = (*seen, comp_name)
        for inst in comp.instructions:
            if inst.opcode == "while":
                n = _trip_count(inst)
                if n is None:
                    self.unknown.add((comp_name, inst.name))
                for callee in inst.called("body"):
                    self.run(callee, mult * (1 if n is None else n), out, seen)
                for callee in inst.called("condition"):  # evaluated once more than the body
                    self.run(callee, mult * (n + 1 if n is not None else 1), out, seen)
            elif inst.opcode == "conditional":
                names = inst.called("branch_computations") or (inst.called("true_computation")
                                                                + inst.called("false_computation"))
                branches = [self.run(callee, mult, {}, seen) for callee in names]
                for key, e in max(branches, key=lambda b: sum(e["bytes"] for e in b.values()), default={}).items():
                    _add(out, key, **e)
            elif inst.opcode in ("call", "async-start"):
                for callee in inst.called("to_apply") + inst.called("calls"):
                    self.run(callee, mult, out, seen)
            elif inst.opcode not in _FREE and not inst.opcode.endswith(("-done", "-update")):
                base = inst.opcode.removesuffix("-start")
                kind = base if base in ("fusion", "custom-call", "copy") else (
                    "collective" if base in _COLLECTIVES else "other")
                result = _result_shape(inst, comp)
                dtype = ",".join(sorted({t for t, _ in _SHAPE_RE.findall(result)})) if kind == "collective" else None
                nbytes = _inst_bytes(inst, comp, self.module, self.overrides)
                _add(out, (comp_name, inst.name), inst.name, kind, nbytes * mult, mult, dtype,
                     shape_bytes(result) * mult, base)
        return out


def _add(out, key, name, kind, bytes, count, dtype, result, op):
    e = out.setdefault(key, {"name": name, "kind": kind, "bytes": 0.0, "count": 0, "dtype": dtype, "result": 0.0,
                             "op": op})
    e["bytes"] += bytes
    e["count"] += count
    e["result"] += result


def modeled_bytes(hlo_text: str, custom_call_bytes: dict[str, int] | None = None) -> dict:
    """HBM bytes one execution moves, modeled (see the module docstring). custom_call_bytes: bytes
    of one launch of a custom-call, keyed by its instruction name or custom_call_target.

    Returns {"total", "by_kind": {fusion, custom-call, copy, collective, other}, "top": the 20
    biggest {name, kind, bytes (all executions), count (executions)}, "collectives": [{name, op,
    dtype, bytes (result bytes, all executions), count}], "unknown_trip_counts": the whiles
    without a known trip count, whose bodies are counted once}."""
    model = _Model(parse_hlo(hlo_text), custom_call_bytes or {})
    entries = model.run(model.module.entry or "", 1, {})
    by_kind = dict.fromkeys(("fusion", "custom-call", "copy", "collective", "other"), 0)
    for e in entries.values():
        by_kind[e["kind"]] += int(e["bytes"])
    ranked = sorted(entries.values(), key=lambda e: -e["bytes"])
    top = [{"name": e["name"], "kind": e["kind"], "bytes": int(e["bytes"]), "count": e["count"]} for e in ranked[:20]]
    collectives = [{"name": e["name"], "op": e["op"], "dtype": e["dtype"], "bytes": int(e["result"]),
                    "count": e["count"]} for e in entries.values() if e["kind"] == "collective"]
    return {"total": sum(by_kind.values()), "by_kind": by_kind, "top": top, "collectives": collectives,
            "unknown_trip_counts": len(model.unknown)}
