"""Reads the TPU compiler's final VLIW bundle listings (``*-final_bundles.txt``).

A TPU core issues one bundle per cycle, in program order, from a statically
scheduled program. ``bundle_path`` walks one listing the way the core would:
it interprets the scalar unit's instructions (integer/predicate arithmetic,
SMEM loads and stores, ``sphi`` at loop headers, conditional ``sbr.rel``
branches with their delay slots) and counts every bundle issued, so skipped
branches (``pl.when`` bodies, pipeline DMAs that do not fire) are not
counted and loops are counted per trip. Vector work never steers control
flow here, so it is only tallied (the op mix), not evaluated.

What the walk cannot know is marked, not guessed silently:

- SMEM filled by DMA from an HBM operand (scalar prefetch: block tables,
  lengths, page tables) holds what ``smem_operands`` gives; else its loads
  are unknown, and a branch on an unknown predicate falls through (its
  region is counted: the "all blocks run" path). Such branches are counted
  in ``unresolved_branches``.
- Bundles of a delay slot follow each branch: their number per listing is
  read from the region markers (1 on v4, 4 on v5e/v5p/v6e, up to 6 on
  tpu7x); an error of a bundle or two per branch is possible.

Usage: ``bundle_path(text)`` -> ``Path``; ``program_path(dump_dir)`` sums
the listings of one compiled program (its top-level ``TLP`` program plus
every kernel or XLA fusion it calls once each).
"""
from __future__ import annotations

import bisect
import collections
import dataclasses
import glob
import os
import re

_BUNDLE = re.compile(r"^\s*(0x[0-9a-f]+|0)\s+(?:(LB|LH|LE|PB|PF|CT):)?\s*:?\s*>*\s*\{")
_COMMENT = re.compile(r"/\*.*?\*/", re.S)
_REGION_START = re.compile(r"Start(?:/End empty)? region (\d+)")
_BOUNDS = re.compile(r"iteration_bounds: \(([\d, ]+)\)")
_DESCRIPTOR = re.compile(r"window_bounds: \(([\d, ]+)\).*?element_size_in_bytes: (\d+)", re.S)
_OP = re.compile(r"^(?:(%[\w.]+)\s*=\s*)?([\w.]+)\s*(.*)$", re.S)
_GRANULE = re.compile(r"size_in_granules=\*/\s*(%?\w+)")
MASK = 0xFFFFFFFF
ARG_TABLE = 0x7F000000
MAX_BUNDLES = 400_000_000


@dataclasses.dataclass
class Op:
  dest: str | None
  opcode: str
  pred: str | None        # "%p.." or "!%p.."
  default: str | None     # value when the predicate is false
  args: list
  raw: str                # the op's text with comments (DMA descriptors)


@dataclasses.dataclass
class Bundle:
  addr: int
  ops: list
  scalar: list            # ops the walk interprets
  regions: list           # regions starting at this bundle
  has_end: bool
  marker: str | None = None   # LB, LH, LE, PB, PF, CT


def _split_top(text: str, sep: str) -> list[str]:
  out, depth, cur = [], 0, []
  i = 0
  while i < len(text):
    c = text[i]
    if c in "[(":
      depth += 1
    elif c in "])":
      depth -= 1
    if depth == 0 and text.startswith(sep, i):
      out.append("".join(cur))
      cur = []
      i += len(sep)
      continue
    cur.append(c)
    i += 1
  out.append("".join(cur))
  return [s.strip() for s in out if s.strip()]


def _parse_op(raw: str) -> Op:
  text = _COMMENT.sub("", raw).strip()
  m = _OP.match(text)
  if m is None:      # not an instruction (a bare value, an annotation)
    return Op(None, "?", None, None, [], raw)
  dest, opcode, rest = m.group(1), m.group(2), m.group(3).strip()
  pred = default = None
  if rest.startswith("[thread:"):
    rest = rest[rest.index("]") + 1:].strip()
  if rest.startswith("(") and (rest.startswith("(%p") or rest.startswith("(!%p")):
    close = rest.index(")")
    inner = [s.strip() for s in rest[1:close].split(",")]
    pred = inner[0]
    default = inner[1] if len(inner) > 1 else None
    rest = rest[close + 1:].lstrip(", ").strip()
  if pred is None:      # a predicate after the address: op [addr] (p), x
    m = re.search(r"\]\s*\((!?%p[\w.]+)(?:,\s*([^)]*))?\)\s*,?", rest)
    if m:
      pred, default = m.group(1), m.group(2)
      rest = rest[:m.start() + 1] + " " + rest[m.end():]
  if opcode == "sst":   # sst [smem:[addr]] value
    close = rest.index("]]") + 2
    args = [rest[:close], rest[close:].strip()]
  else:
    args = _split_top(rest, ",")
  return Op(dest, opcode, pred, default, args, raw)


def _scalar(op: Op) -> bool:
  c = op.opcode
  return (c[0] in "sp" or c.startswith("scalar_") or c.startswith("int_to_ptr")
          or c.startswith("dma.") or c == "inlined_call_operand.hbm"
          or c.startswith("inlined_call_operand"))


def parse(text: str) -> list[Bundle]:
  """The bundles of a listing, in address order."""
  chunks, cur = [], None
  for line in text.split("\n"):
    m = _BUNDLE.match(line)
    if m:
      cur = [int(m.group(1), 16), [line], m.group(2)]
      chunks.append(cur)
    elif cur is not None:
      cur[1].append(line)
  out = []
  for addr, lines, marker in chunks:
    body = "\n".join(lines)
    start = body.index("{") + 1
    # The bundle's ops end at the last "}" outside comments.
    stripped = _COMMENT.sub(lambda m: " " * len(m.group(0)), body)
    end = stripped.rindex("}")
    inner, tail = body[start:end], body[end:]
    raws = _split_top_comments(inner)
    ops = [_parse_op(r) for r in raws]
    out.append(Bundle(addr, ops, [o for o in ops if _scalar(o)],
                      [int(r) for r in _REGION_START.findall(tail)],
                      "End region" in tail, marker))
  return out


def _split_top_comments(inner: str) -> list[str]:
  """Splits a bundle's text on ';;' outside comments."""
  parts, last, i = [], 0, 0
  while i < len(inner):
    if inner.startswith("/*", i):
      i = inner.index("*/", i) + 2
      continue
    if inner.startswith(";;", i):
      parts.append(inner[last:i])
      last = i = i + 2
      continue
    i += 1
  parts.append(inner[last:])
  return [p.strip() for p in parts if p.strip()]


# ------------------------------------------------------------------ op mix
MIX = ("mxu_push", "mxu_matmul", "mxu_pop", "valu", "eup", "xlu", "vld", "vst",
       "scalar", "dma", "dma_bytes")


def _mix_of(op: Op) -> str | None:
  c = op.opcode
  if c.startswith("vmatpush"):
    return "mxu_push"
  if c.startswith("vmatmul"):
    return "mxu_matmul"
  if c.startswith("vpop") and (".mrf" in c or ".mrb" in c or "mxu" in c):
    return "mxu_pop"
  if c.startswith("vpop.eup"):
    return "eup"
  if ".xlu" in c:
    return None if c.startswith("vpop") else "xlu"
  if c.startswith("vld"):
    return "vld"
  if c.startswith("vst"):
    return "vst"
  if c.startswith("dma.") and not c.startswith("dma.done"):
    return "dma"
  if c.startswith("vsync") or c.startswith("vdelay") or c.startswith("vpop"):
    return None
  if c.startswith("v"):
    return "valu"
  if c[0] in "sp":
    return "scalar"
  return None


def _dma_bytes(op: Op) -> int:
  m = _DESCRIPTOR.search(op.raw)
  if m:
    n = 1
    for x in m.group(1).split(","):
      n *= int(x)
    return n * int(m.group(2))
  g = _GRANULE.search(op.raw)
  if g and g.group(1).isdigit():
    return int(g.group(1)) * 32   # 32-byte granules (checked on v5e windows)
  return 0


# ------------------------------------------------------------------- walk
class _Unknown(Exception):
  pass


@dataclasses.dataclass
class Path:
  """One listing's walk. ``iterations``: bundles issued per trip of the
  outermost loop (for a Mosaic kernel: the grid loop, ``grid_steps`` plus
  the pipeline's ramp trips); ``prologue``/``epilogue``: bundles before and
  after it. ``total`` = everything issued."""
  total: int
  static: int                 # bundles in the listing
  grid: tuple | None          # iteration_bounds
  prologue: int
  iterations: list
  epilogue: int
  mix: dict
  unresolved_branches: int
  delay_slots: int
  unresolved_at: list = dataclasses.field(default_factory=list)

  @property
  def first(self) -> int:
    return self.prologue + (self.iterations[0] if self.iterations else 0)

  @property
  def last(self) -> int:
    return self.epilogue + (self.iterations[-1] if self.iterations else 0)

  @property
  def steady(self) -> int:
    """Median bundles of the trips between the first and the last."""
    inner = sorted(self.iterations[1:-1] or self.iterations)
    return inner[len(inner) // 2] if inner else self.total


def _delay_slots(bundles: list[Bundle]) -> int:
  ends = [i for i, b in enumerate(bundles) if b.has_end]
  dists = []
  for i, b in enumerate(bundles):
    if any(o.opcode.startswith("sbr") for o in b.scalar):
      j = bisect.bisect_left(ends, i)
      if j < len(ends) and ends[j] - i <= 8:
        dists.append(ends[j] - i)
  return max(dists) if dists else 4


def _alloc_base(name: str) -> int:
  m = re.match(r"allocation(\d+)(_spill)?", name)
  if not m:
    return (hash(name) & 0x3FFF) << 14 | 1 << 28
  return (1 << 28) + ((int(m.group(1)) * 2 + bool(m.group(2))) << 12)


def bundle_path(text: str, smem_operands: dict | None = None,
                core: int = 0) -> Path:
  """Walks one listing (see the module docstring). ``smem_operands``: HBM
  operand index -> list of int32 values, for the scalar-prefetch operands
  a DMA copies into SMEM. ``core``: the value core-index reads return."""
  bundles = parse(text)
  smem_operands = smem_operands or {}
  grid = _BOUNDS.search(text)
  grid = tuple(int(x) for x in grid.group(1).split(",")) if grid else None
  delay = _delay_slots(bundles)
  index = {b.addr: i for i, b in enumerate(bundles)}
  region_at = {}
  for i, b in enumerate(bundles):
    for r in b.regions:
      region_at.setdefault(r, i)
  interesting = [bool(b.scalar) for b in bundles]
  nxt = [len(bundles)] * (len(bundles) + 1)
  for i in range(len(bundles) - 1, -1, -1):
    nxt[i] = i if interesting[i] else nxt[i + 1]
  # Outermost loop: the backward branch reaching furthest back.
  loop_head = loop_branch = None
  for i, b in enumerate(bundles):
    for o in b.scalar:
      if o.opcode.startswith("sbr"):
        t = region_at.get(int(o.args[-1].split("$region")[-1]))
        if t is not None and t <= i and (loop_head is None or t < loop_head):
          loop_head, loop_branch = t, i

  vals: dict = {}
  smem: dict = {}
  operands: dict = {}
  counts = [0] * len(bundles)
  unresolved = 0
  unresolved_at = set()
  dmas = [0, 0]           # DMAs issued (predicate true or unknown), bytes

  def val(tok: str):
    tok = re.sub(r"^\[resolvable:[^\]]*\]\s*", "", tok.strip())
    if tok.startswith("!"):
      v = val(tok[1:])
      return None if v is None else (not v)
    if tok.startswith("%"):
      return vals.get(tok)
    if tok.startswith("[") and "smem:" not in tok:
      return addr_of(tok)
    if tok.startswith("$"):
      return int(tok[1:], 0)
    try:
      return int(tok, 0) & MASK
    except ValueError:
      try:
        return float(tok)
      except ValueError:
        return None

  def addr_of(tok: str):
    inner = tok.strip()
    while inner.startswith("["):
      inner = inner[1:-1].strip()
      if inner.startswith("smem:"):
        inner = inner[5:].strip()
    total = 0
    for term in inner.split("+"):
      term = term.strip()
      if term.startswith("#"):
        total += _alloc_base(term[1:])
      else:
        v = val(term)
        if v is None:
          return None
        total += int(v)
    return total & MASK

  def s32(x):
    return x - (1 << 32) if x & 0x80000000 else x

  def compute(op: Op):
    c, a = op.opcode, op.args
    if c == "sphi":
      raise AssertionError
    if c in ("smov", "pmov") or c.startswith("int_to_ptr"):
      return val(a[-1])
    if c.startswith("inlined_call_operand"):
      m = re.search(r"index: (-?\d+)", op.raw)
      if m and m.group(1) == "-1":
        return ARG_TABLE       # a table in SMEM of the operands' addresses
      k = int(m.group(1)) if m else 1000 + len(operands)
      if "<no memory space>" in op.raw and re.search(
          r"shape: [su]32\[1?\]", op.raw):
        # A scalar passed by value (a dynamic grid bound, or a [1] array
        # such as ragged_paged_attention's num_seqs): its value.
        data = smem_operands.get(k)
        return None if not data else int(data[0]) & MASK
      operands[(k + 1) << 20] = k
      return (k + 1) << 20
    if c == "sld":
      if "core id" in op.raw:     # megacore: the walk follows ``core``
        return core
      ad = addr_of(a[0])
      if ad is not None and ARG_TABLE <= ad < ARG_TABLE + 4096:
        k = ad - ARG_TABLE
        operands[(k + 1) << 20] = k
        return (k + 1) << 20
      return None if ad is None else smem.get(ad)
    if c == "scalar_select":
      p, x, y = (val(t) for t in a[:3])
      return None if p is None else (x if p else y)
    xs = [val(t) for t in a]
    if any(x is None for x in xs):
      return None
    if c == "pneg":
      return not xs[0]
    if c == "pnand":
      return not (xs[0] and xs[1])
    if c == "por":
      return bool(xs[0] or xs[1])
    if c == "pand":
      return bool(xs[0] and xs[1])
    if c == "pnor":
      return not (xs[0] or xs[1])
    if c == "pxor":
      return bool(xs[0]) != bool(xs[1])
    if c.startswith("scmp."):
      kind = c.split(".")[1]
      x, y = xs[0], xs[1]
      if ".s32" in c:
        x, y = s32(int(x)), s32(int(y))
      return {"eq": x == y, "ne": x != y, "lt": x < y, "le": x <= y,
              "gt": x > y, "ge": x >= y}[kind]
    if c.startswith("scalar_lea"):
      return (int(xs[0]) + int(xs[1]) if len(xs) > 1 else int(xs[0])) & MASK
    x = int(xs[0]) if xs else 0
    y = int(xs[1]) if len(xs) > 1 else 0
    base = c.split(".")[0]
    if base == "sadd":
      return (x + y) & MASK
    if base == "ssub":
      return (x - y) & MASK
    if base == "smul":
      return (x * y) & MASK
    if base == "sand":
      return x & y
    if base == "sor":
      return x | y
    if base == "sxor":
      return x ^ y
    if base == "sshll":
      return (x << (y & 31)) & MASK
    if base == "sshrl":
      return x >> (y & 31)
    if base == "sshra":
      return (s32(x) >> (y & 31)) & MASK
    if base in ("smin", "smax"):
      f = min if base == "smin" else max
      if ".s32" in c:
        return f(s32(x), s32(y)) & MASK
      return f(x, y)
    if base in ("sdiv", "srem"):
      if ".s32" in c:
        x, y = s32(x), s32(y)
      if y == 0:
        return None
      q = int(x / y)
      return (q if base == "sdiv" else x - q * y) & MASK
    return None   # unknown scalar op: its value is unknown

  def side_effect(op: Op):
    if op.opcode.startswith("dma.") and not op.opcode.startswith("dma.done"):
      dmas[0] += 1
      dmas[1] += _dma_bytes(op)
    if op.opcode == "sst":
      ad, v = addr_of(op.args[0]), val(op.args[1])
      if ad is not None:
        smem[ad] = v
    elif op.opcode.startswith("dma.") and op.opcode.endswith("_to_smem"):
      src, dst = val(op.args[0]), val(op.args[2])
      data = None
      for cand in (src, None if src is None else src >> 4):
        if cand in operands:
          data = smem_operands.get(operands[cand])
      if dst is not None:
        # Unknown contents: forget what the destination held.
        for k in range(4096):
          if data is not None and k < len(data):
            smem[dst + k] = int(data[k]) & MASK
          else:
            smem.pop(dst + k, None)

  def run(i: int, came_back: bool):
    """Issues bundle ``i``: its scalar ops, in dependency order (the ops
    of a bundle read each other's results: a phi, a pointer cast)."""
    b = bundles[i]
    branch = None
    done = set()
    for op in b.scalar:
      if op.opcode == "sphi":
        vals[op.dest] = vals.get(op.args[-1] if came_back else op.args[0])
        done.add(id(op))
    defined_here = {o.dest for o in b.scalar if o.dest and id(o) not in done}
    ready = set()
    progress = True
    while progress:
      progress = False
      for op in b.scalar:
        if id(op) in done:
          continue
        if any(t.lstrip("!") in defined_here and t.lstrip("!") not in ready
               for t in _tokens(op)):
          continue
        done.add(id(op))
        progress = True
        p = val(op.pred) if op.pred else True
        if op.opcode.startswith("sbr"):
          branch = (op, p)
        elif op.dest and op.dest.startswith(("%s", "%p")):
          if p is None:
            vals[op.dest] = None
          elif p:
            vals[op.dest] = compute(op)
          elif op.default is not None:
            vals[op.dest] = val(op.default)
        elif p is None or p:
          side_effect(op)
        if op.dest:
          ready.add(op.dest)
    return branch

  segments = collections.Counter()
  pc, came_back = 0, False
  issued = 0
  head_hits = []          # issued count at each arrival at the loop head
  loop_exit = None        # issued count when leaving the outer loop
  while pc < len(bundles):
    if not interesting[pc]:
      j = nxt[pc]
      segments[(pc, j)] += 1
      issued += j - pc
      pc = j
      continue
    if pc == loop_head:
      head_hits.append(issued)
    counts[pc] += 1
    issued += 1
    if issued > MAX_BUNDLES:
      raise RuntimeError("bundle_path: walk exceeded its bound (a loop on "
                         "unknown data?)")
    branch = run(pc, came_back)
    came_back = False
    if branch is None:
      pc += 1
      continue
    op, p = branch
    if p is None:
      unresolved += 1
      unresolved_at.add(bundles[pc].addr)
      if _DEBUG and len(unresolved_at) == 1 and unresolved == 1:
        _explain(bundles, vals, op.pred)
      p = False
    # Delay slots issue whatever the branch does.
    for k in range(1, delay + 1):
      if pc + k < len(bundles):
        counts[pc + k] += 1
        issued += 1
        run(pc + k, False)
    if p:
      target = region_at.get(int(op.args[-1].split("$region")[-1]))
      if target is None:
        # A region with no start marker: the next control target or
        # fall-through (a loop's exit) after the delay slots.
        target = next((j for j in range(pc + delay + 1, len(bundles))
                       if bundles[j].marker in ("PF", "CT", "LE")),
                      len(bundles))
      came_back = target <= pc
      if pc == loop_branch and not came_back:
        loop_exit = issued
      pc = target
    else:
      if pc == loop_branch:
        loop_exit = issued
      pc = pc + delay + 1
  for (a, b), n in segments.items():
    for i in range(a, b):
      counts[i] += n

  mix = collections.Counter()
  for i, n in enumerate(counts):
    if n:
      for o in bundles[i].ops:
        kind = _mix_of(o)
        if kind and kind != "dma":
          mix[kind] += n
  mix["dma"], mix["dma_bytes"] = dmas
  if head_hits:
    marks = head_hits + [loop_exit if loop_exit is not None else issued]
    iterations = [b - a for a, b in zip(marks, marks[1:])]
    prologue = head_hits[0]
    epilogue = issued - marks[-1]
  else:
    iterations, prologue, epilogue = [], issued, 0
  return Path(total=issued, static=len(bundles), grid=grid, prologue=prologue,
              iterations=iterations, epilogue=epilogue,
              mix={k: mix.get(k, 0) for k in MIX},
              unresolved_branches=unresolved, delay_slots=delay,
              unresolved_at=sorted(unresolved_at))


_DEBUG = bool(os.environ.get("TPU_BUNDLES_DEBUG"))


def _explain(bundles, vals, name, depth=0, seen=None):
  """Prints the unknown inputs behind ``name`` (TPU_BUNDLES_DEBUG=1)."""
  seen = set() if seen is None else seen
  name = name.lstrip("!")
  if name in seen or depth > 12:
    return
  seen.add(name)
  for b in bundles:
    for o in b.scalar:
      if o.dest == name:
        print("  " * depth + f"{hex(b.addr)} {name} = {o.opcode} {o.args} "
              f"pred={o.pred} -> {vals.get(name)}")
        for t in _tokens(o):
          if vals.get(t.lstrip("!")) is None:
            _explain(bundles, vals, t, depth + 1, seen)
        return


_TOKEN = re.compile(r"!?%[sp][\w.]+")


def _tokens(op: Op) -> list[str]:
  out = _TOKEN.findall(" ".join(op.args))
  if op.pred:
    out.append(op.pred)
  if op.default:
    out.append(op.default)
  return out


# ------------------------------------------------------------- a program
def listing_files(dump_dir: str) -> dict[str, str]:
  """Program name -> path of its ``*-final_bundles.txt`` in a dump."""
  out = {}
  for path in sorted(glob.glob(os.path.join(dump_dir, "*-final_bundles.txt"))):
    base = os.path.basename(path)
    if "schedule-analysis" in base:
      continue
    m = re.match(r"^\d+-(.*)-\d+-final_bundles\.txt$", base)
    out[m.group(1) if m else base] = path
  return out


def _words(values: list, bits: int) -> list:
  """Values of a ``bits``-wide integer array as the 32-bit SMEM words that
  hold them (narrow types pack little-endian, as in HBM)."""
  if bits >= 32:
    return values
  per = 32 // bits
  out = []
  for i in range(0, len(values), per):
    w = 0
    for j, v in enumerate(values[i:i + per]):
      w |= (v & ((1 << bits) - 1)) << (bits * j)
    out.append(w)
  return out


def _tiled(values: list, body: str) -> list:
  """A row-major 2-D array laid out in its HLO tiling, e.g.
  ``s32[8,64]{1,0:T(8,128)}`` (rows padded to whole tiles)."""
  m = re.match(r"\w+\[(\d+),(\d+)\]\{1,0:T\((\d+),(\d+)\)", body)
  if not m:
    return values
  r, c, tr, tc = (int(x) for x in m.groups())
  cp = -(-c // tc) * tc
  out = [0] * (-(-r // tr) * tr * cp)
  for i in range(r):
    for j in range(c):
      out[(i // tr) * tr * cp + (j // tc) * tr * tc + (i % tr) * tc
          + j % tc] = values[i * c + j]
  return out


_CLAMPS = {"parameter", "constant", "broadcast", "clamp", "minimum",
           "maximum", "bitcast", "copy", "reshape"}
_HLO_DEF = re.compile(r"^\s*(?:ROOT\s+)?(%[\w.\-]+)\s*=\s*(.*)$")


def hlo_operand_values(hlo_text: str, params: dict | None = None) -> dict:
  """Kernel/fusion name -> {operand index: int values} for the operands of
  each call in an HLO dump that are integer constants, or entry parameters
  given in ``params`` (parameter number -> values), possibly through
  bitcasts, copies and reshapes."""
  defs = {}
  bodies = {}         # computation -> its instructions' opcodes
  current = None
  for line in hlo_text.splitlines():
    head = re.match(r"^(?:ENTRY\s+)?(%[\w.\-]+)\s*\(.*\{\s*$", line)
    if head:
      current = bodies.setdefault(head.group(1), set())
      continue
    if line.startswith("}"):
      current = None
    m = _HLO_DEF.match(line)
    if m:
      defs.setdefault(m.group(1), m.group(2))
      if current is not None:
        op = re.search(r"\s([a-z][\w\-]*)\(", " " + m.group(2))
        current.add(op.group(1) if op else "?")

  def values(name, depth=0):
    body = defs.get(name)
    if body is None or depth > 8:
      return None
    m = re.search(r"\bconstant\((.*)\)", body)
    t = re.match(r"([su])(\d+)\[|pred\[", body)
    if m and t:
      return [int(x) for x in re.findall(r"-?\d+", re.sub(
          r"true", "1", re.sub(r"false", "0", m.group(1))))]
    m = re.search(r"\bparameter\((\d+)\)", body)
    if m and params and int(m.group(1)) in params:
      return [int(x) for x in params[int(m.group(1))]]
    m = re.search(r"\bbroadcast\((%[\w.\-]+)\)", body)
    if m:
      v = values(m.group(1), depth + 1)
      dims = re.match(r"\w+\[([\d,]*)\]", body)
      n = 1
      for x in (dims.group(1).split(",") if dims and dims.group(1) else []):
        n *= int(x)
      return None if v is None or len(v) != 1 else v * n
    # An unfused clip (minimum/maximum/clamp against constants): the
    # bench's values are in range, as for a clamp fusion.
    m = re.search(r"\b(?:minimum|maximum|clamp)\(([^)]*)\)", body)
    if m:
      ops = [_COMMENT.sub("", t).strip() for t in m.group(1).split(",")]
      live = [t for t in ops if not re.search(r"\bconstant\(",
                                              defs.get(t, ""))]
      return values(live[0], depth + 1) if len(live) == 1 else None
    # A clamp fusion (jnp.clip of lengths): the bench's values are in range.
    m = re.search(r"\bfusion\((%[\w.\-]+)\).*calls=(%[\w.\-]+)", body)
    if m and bodies.get(m.group(2), {"?"}) <= _CLAMPS:
      return values(m.group(1), depth + 1)
    m = re.search(r"\b(?:bitcast|copy|reshape|copy-done|copy-start)\((%[\w.\-]+)\)", body)
    if m:
      return values(m.group(1), depth + 1)
    return None

  out = {}
  for name, body in defs.items():
    m = re.search(r"\b(?:custom-call|fusion)\(([^)]*)\)", body)
    if not m:
      continue
    ops = [_COMMENT.sub("", t).strip() for t in m.group(1).split(",")]
    ops = [t for t in ops if t]
    known = {}
    for k, op in enumerate(ops):
      v = values(op)
      if v is not None:
        # As the operand is laid out: its tiling, its element width.
        bits = re.match(r"[su](\d+)\[", defs[op])
        known[k] = _words(_tiled(v, defs[op]),
                          int(bits.group(1)) if bits else 8)
    if known:
      out[name.lstrip("%")] = known
  return out


def program_path(dump_dir: str, params: dict | None = None) -> dict:
  """Walks every listing of one compiled program: name -> Path. Scalar
  prefetch operands that are constants in the program's HLO (or entry
  parameters given in ``params``: number -> values) fill SMEM. The
  ``"TLP"`` listing is the top-level program; each other listing is a
  kernel or fusion it calls (once each, unless XLA loops around it)."""
  hlo = ""
  for path in glob.glob(os.path.join(dump_dir, "*-hlo.txt")):
    with open(path) as f:
      hlo += f.read() + "\n"
  known = hlo_operand_values(hlo, params)
  out = {}
  for name, path in listing_files(dump_dir).items():
    with open(path) as f:
      text = f.read()
    out[name] = bundle_path(text, known.get(name))
  return out
