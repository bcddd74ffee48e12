"""A stage's backward split in two, as zero-bubble pipelining needs it (Qi et al. 2023,
"Zero Bubble Pipeline Parallelism"): B, the input's gradient (what the stage before waits
for), and W, the weight gradients (which can wait). Not by recomputing: B also outputs
what W needs of it (each weight gradient's output cotangent and input, per layer), and W
is only the work B did not do.

The split is made on the traced backward (a jaxpr), by what the input's gradient needs:
B is every equation dx depends on, W every other one. A layer scan is split in two scans:
B's carries the input's cotangent and stacks, per layer, the values W reads of it; W's
scans those. Remat and nested jit are inlined first, so a remat policy's recomputation
lands in B, once, and W reads what it recomputed. A primitive with a body of its own
(a `cond`, a `shard_map`, a custom rule) is not looked into: it is B's if dx needs any of
its outputs, else W's."""

from __future__ import annotations

import dataclasses

import jax
from jax._src import core  # The jaxpr data structures the split works on.

_INLINED = ("remat2", "jit", "pjit")
# Elementwise, reduction and layout primitives (no matmul, collective, or body of its
# own): cheap enough to compute once (`_cse`) and to move from W to B where that shrinks
# the stash (`_push`).
_CHEAP = frozenset((
    "mul", "add", "add_any", "sub", "neg", "div", "max", "min", "abs", "sign", "square",
    "integer_pow", "sqrt", "rsqrt", "exp", "log", "tanh", "logistic", "select_n",
    "convert_element_type", "reduce_sum", "reduce_max", "reshape", "squeeze",
    "expand_dims", "broadcast_in_dim", "transpose", "copy"))


@dataclasses.dataclass(frozen=True)
class Split:
  """B = `known`: (params, kept residuals, dy, aux-loss cotangent) -> (dx and the
  parameter gradients B computes, then the stash); W = `unknown`: (stash, params, kept
  residuals) -> the parameter gradients B does not. out_in_w[i]: whether output i of the
  backward (its parameter gradients, then dx) is W's; kept_in_w[j]: whether W reads kept
  residual j (else it can go once B has run)."""

  known: core.ClosedJaxpr
  unknown: core.ClosedJaxpr
  out_in_w: tuple[bool, ...]
  kept_in_w: tuple[bool, ...]
  stash: tuple[jax.ShapeDtypeStruct, ...]


def split(backward, param_leaves: list, kept_leaves: list, dy, one) -> Split:
  """backward(param_leaves, kept_leaves, dy, one) -> (d_param_leaves, dx), traced on these
  values, split into B and W. kept_leaves must be typed as the forward made them (varying
  over the manual axes or not). At run time the schedule hands them in from its rings,
  typed varying: `run_b` and `run_w` let the backward's casts of them pass."""
  closed = jax.make_jaxpr(backward)(param_leaves, kept_leaves, dy, one)
  jaxpr = _cse(_inline(closed.jaxpr))
  n_out = len(jaxpr.outvars)
  b_eqns, w_eqns = _partition(jaxpr.eqns, jaxpr.outvars, [False] * (n_out - 1) + [True])
  n_pk = len(param_leaves) + len(kept_leaves)
  w_outs = [v for v in jaxpr.outvars[:-1] if _defined_in(v, w_eqns)]
  w_eqns = _live(w_eqns, w_outs)  # Not what no output reads: it would be stashed for.
  b_eqns, w_eqns = _push(b_eqns, w_eqns, w_outs, set(jaxpr.invars),
                         set(jaxpr.invars[n_pk:]))
  w_outs = [v for v in w_outs if _defined_in(v, w_eqns)]
  w_out_set = set(w_outs)
  out_in_w = tuple(isinstance(v, core.Var) and v in w_out_set for v in jaxpr.outvars)
  b_outs = [v for v, w in zip(jaxpr.outvars, out_in_w) if not w]
  # What W reads of B's: values B's equations define, and B's own inputs (dy, the aux
  # loss's cotangent); W takes the parameters and kept residuals as they are.
  stash = [v for v in _reads(w_eqns, w_outs)
           if v in _defs(b_eqns) or v in set(jaxpr.invars[n_pk:])]
  consts = list(zip(jaxpr.constvars, closed.consts))
  known = _closed(consts, jaxpr.invars, [*b_outs, *stash], b_eqns)
  unknown = _closed(consts, [*stash, *jaxpr.invars[:n_pk]], w_outs, w_eqns)
  shapes = tuple(jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in stash)
  w_reads = set(_reads(w_eqns, w_outs))
  kept_in_w = tuple(v in w_reads for v in jaxpr.invars[len(param_leaves):n_pk])
  return Split(known, unknown, out_in_w, kept_in_w, shapes)


def run_b(s: Split, param_leaves, kept_leaves, dy, one):
  """B: (the backward's outputs, None where W's; the stash)."""
  outs = _eval(s.known, *param_leaves, *kept_leaves, dy, one)
  n_b = len(outs) - len(s.stash)
  b_outs = iter(outs[:n_b])
  return [None if w else next(b_outs) for w in s.out_in_w], list(outs[n_b:])


def run_w(s: Split, param_leaves, kept_leaves, stash):
  """W: the backward's outputs, None where B's."""
  outs = iter(_eval(s.unknown, *stash, *param_leaves, *kept_leaves))
  return [next(outs) if w else None for w in s.out_in_w]


def _closed(consts, invars, outvars, eqns) -> core.ClosedJaxpr:
  """A ClosedJaxpr of `eqns` with only the constants they read."""
  used = _reads(eqns, outvars)
  consts = [(v, c) for v, c in consts if v in used]
  jaxpr = core.Jaxpr([v for v, _ in consts], invars, outvars, eqns, _effects(eqns))
  return core.ClosedJaxpr(jaxpr, [c for _, c in consts])


def _effects(eqns):
  return core.join_effects(*(e.effects for e in eqns)) if eqns else core.no_effects


def _is_var(v) -> bool:
  return isinstance(v, core.Var) and not isinstance(v, core.DropVar)


def _reads(eqns, outvars) -> list:
  """The variables the equations and outputs read that they do not define, in order."""
  seen, out = set(), []
  for v in [x for e in eqns for x in e.invars] + list(outvars):
    if _is_var(v) and v not in seen:
      seen.add(v)
      out.append(v)
  defined = _defs(eqns)
  return [v for v in out if v not in defined]


def _defs(eqns) -> set:
  return {v for e in eqns for v in e.outvars if _is_var(v)}


def _defined_in(v, eqns) -> bool:
  return _is_var(v) and v in _defs(eqns)


def _inline(jaxpr: core.Jaxpr) -> core.Jaxpr:
  """`jaxpr` with remat and nested jit equations replaced by their bodies (fresh
  variables per inlining), in scan bodies too."""
  sub: dict = {}
  read = lambda v: sub.get(v, v) if isinstance(v, core.Var) else v
  eqns = []
  for eqn in jaxpr.eqns:
    invars = [read(v) for v in eqn.invars]
    name = eqn.primitive.name
    if name in _INLINED:
      inner = eqn.params["jaxpr"]
      consts = inner.consts if isinstance(inner, core.ClosedJaxpr) else ()
      inner = _inline(inner.jaxpr if isinstance(inner, core.ClosedJaxpr) else inner)
      if consts:  # A jit closing over values: leave it whole.
        eqns.append(eqn.replace(invars=invars))
        continue
      rename = dict(zip(inner.invars, invars))
      for e in inner.eqns:
        outs = [core.Var(v.aval) if _is_var(v) else v for v in e.outvars]
        rename.update({v: o for v, o in zip(e.outvars, outs) if _is_var(v)})
        eqns.append(e.replace(invars=[rename.get(v, v) if isinstance(v, core.Var) else v
                                      for v in e.invars], outvars=outs))
      for v, o in zip(eqn.outvars, inner.outvars):
        if _is_var(v):
          sub[v] = rename.get(o, o) if isinstance(o, core.Var) else o
      continue
    if name == "scan":
      body = eqn.params["jaxpr"]
      params = dict(eqn.params, jaxpr=core.ClosedJaxpr(_inline(body.jaxpr), body.consts))
      eqns.append(eqn.replace(invars=invars, params=params))
      continue
    eqns.append(eqn.replace(invars=invars))
  outvars = [read(v) for v in jaxpr.outvars]
  return core.Jaxpr(jaxpr.constvars, jaxpr.invars, outvars, eqns, _effects(eqns),
                    jaxpr.debug_info)


def _cse(jaxpr: core.Jaxpr) -> core.Jaxpr:
  """`jaxpr` with repeated cheap equations (the same primitive, parameters and inputs)
  computed once, in scan bodies too: autodiff reshapes a layer's normed input once per
  projection that reads it, and each copy would be a stash entry of its own."""
  sub, seen, eqns = {}, {}, []
  read = lambda v: sub.get(v, v) if isinstance(v, core.Var) else v
  for eqn in jaxpr.eqns:
    eqn = eqn.replace(invars=[read(v) for v in eqn.invars])
    if eqn.primitive.name == "scan":
      body = eqn.params["jaxpr"]
      eqn = eqn.replace(params=dict(eqn.params, jaxpr=core.ClosedJaxpr(_cse(body.jaxpr),
                                                                      body.consts)))
    key = None
    if eqn.primitive.name in _CHEAP and not eqn.effects and all(
        isinstance(v, core.Var) for v in eqn.invars):
      try:
        key = (eqn.primitive.name, tuple(eqn.invars), tuple(sorted(eqn.params.items())))
        hash(key)
      except TypeError:  # A parameter that is not hashable: leave the equation be.
        key = None
    if key is not None and key in seen:
      sub.update((v, o) for v, o in zip(eqn.outvars, seen[key]) if _is_var(v))
      continue
    if key is not None:
      seen[key] = eqn.outvars
    eqns.append(eqn)
  return core.Jaxpr(jaxpr.constvars, jaxpr.invars, [read(v) for v in jaxpr.outvars], eqns,
                    _effects(eqns), jaxpr.debug_info)


def _live(eqns, outvars) -> list:
  """The equations `outvars` depend on (and any with effects), in order."""
  live, kept = {v for v in outvars if _is_var(v)}, []
  for eqn in reversed(eqns):
    if eqn.effects or any(_is_var(v) and v in live for v in eqn.outvars):
      kept.append(eqn)
      live.update(v for v in eqn.invars if _is_var(v))
  return kept[::-1]


def _push(b_eqns, w_eqns, w_outs, b_avail: set, stashed: set) -> tuple[list, list]:
  """Moves W's cheap equations into B where that shrinks the stash: one whose inputs B
  has, and whose outputs take fewer bytes than the stashed inputs only it reads (a norm
  scale's gradient: two float32 activations in, a vector out; a gated FFN's product: two
  F-wide factors in, one out). Greedy, in W's order; `stashed`: B's values that W reads
  through the stash (B's own defined values are added as found)."""
  avail, stashed = b_avail | _defs(b_eqns), stashed | _defs(b_eqns)
  readers: dict = {}
  for v in [x for e in w_eqns for x in e.invars] + list(w_outs):
    if _is_var(v):
      readers[v] = readers.get(v, 0) + 1
  nbytes = lambda v: v.aval.size * v.aval.dtype.itemsize
  b_eqns, kept = list(b_eqns), []
  for eqn in w_eqns:
    ins = [v for v in eqn.invars if _is_var(v)]
    if eqn.primitive.name in _CHEAP and not eqn.effects and all(v in avail for v in ins):
      mine = {v: ins.count(v) for v in ins}
      freed = sum(nbytes(v) for v, n in mine.items() if v in stashed and readers[v] == n)
      if sum(nbytes(v) for v in eqn.outvars if _is_var(v)) < freed:
        b_eqns.append(eqn)
        outs = {v for v in eqn.outvars if _is_var(v)}
        avail |= outs
        stashed |= outs
        for v in ins:
          readers[v] -= 1
        continue
    kept.append(eqn)
  return b_eqns, kept


def _partition(eqns, outvars, b_needed: list[bool]) -> tuple[list, list]:
  """(B's equations, W's): B's, what the outputs marked in b_needed depend on (and any
  with effects); W's, the rest. A scan that B needs only part of splits in two."""
  live = {v for v, n in zip(outvars, b_needed) if n and _is_var(v)}
  b_rev, w_rev = [], []
  for eqn in reversed(eqns):
    need = [_is_var(v) and v in live for v in eqn.outvars]
    if not any(need) and not eqn.effects:
      w_rev.append(eqn)
      continue
    if eqn.primitive.name == "scan" and not all(need) and not eqn.effects:
      b_eqn, w_eqn = _split_scan(eqn, need)
      if w_eqn is not None:
        w_rev.append(w_eqn)
      eqn = b_eqn
    b_rev.append(eqn)
    live.update(v for v in eqn.invars if _is_var(v))
  return b_rev[::-1], w_rev[::-1]


def _split_scan(eqn, need: list[bool]):
  """A scan whose outputs `need` marks as B's: (B's scan, W's scan or None). B's carries
  what its outputs need (a fixed point over the carries) and stacks, per iteration, the
  values W's body reads of B's; W's scan reads those stacks as inputs."""
  p = eqn.params
  body, nc, nk = p["jaxpr"].jaxpr, p["num_consts"], p["num_carry"]
  carry_in = body.invars[nc:nc + nk]
  need = list(need)
  while True:
    b_body, w_body = _partition(body.eqns, body.outvars, need)
    used = set(_reads(b_body, [v for v, n in zip(body.outvars, need) if n]))
    carries = [need[i] or carry_in[i] in used for i in range(nk)]
    if carries == need[:nk]:
      break
    need[:nk] = carries
  if all(need):
    return eqn, None
  pick = lambda seq, keep: [v for v, k in zip(seq, keep) if k]
  b_carry, w_carry = need[:nk], [not n for n in need[:nk]]
  # W's scan only if an output of it is read (else no W, and nothing stashed for it).
  has_w = any(_is_var(v) for v in pick(eqn.outvars, [not n for n in need]))
  w_outs = [v for v, n in zip(body.outvars, need) if not n]
  w_body = _live(w_body, w_outs) if has_w else []
  b_carry_in = {v for v, n in zip(carry_in, need) if n}
  b_body, w_body = _push(b_body, w_body, w_outs,
                         b_carry_in | set(body.invars[:nc]) | set(body.invars[nc + nk:]),
                         b_carry_in)
  b_side = _defs(b_body) | b_carry_in
  boundary = [v for v in _reads(w_body, w_outs) if v in b_side] if has_w else []
  consts, xs = body.invars[:nc], body.invars[nc + nk:]
  outer_consts, outer_xs = eqn.invars[:nc], eqn.invars[nc + nk:]
  outer_carry = eqn.invars[nc:nc + nk]
  length = p["length"]
  stacked = [core.Var(v.aval.update(shape=(length, *v.aval.shape))) for v in boundary]

  def scan(carry, outvars, body_carry, body_out, body_eqns, extra=(), extra_body=()):
    """A scan of body_eqns over the consts and xs they read (each scan reads only its
    own: a residual W does not read is not W's)."""
    reads = set(_reads(body_eqns, body_out))
    keep_c, keep_x = [v in reads for v in consts], [v in reads for v in xs]
    body_jaxpr = core.Jaxpr(body.constvars, [*pick(consts, keep_c), *body_carry,
                                             *pick(xs, keep_x), *extra_body], body_out,
                            body_eqns, _effects(body_eqns), body.debug_info)
    params = dict(p, jaxpr=core.ClosedJaxpr(body_jaxpr, p["jaxpr"].consts),
                  num_consts=sum(keep_c), num_carry=len(body_carry))
    invars = [*pick(outer_consts, keep_c), *carry, *pick(outer_xs, keep_x), *extra]
    return eqn.replace(invars=invars, outvars=outvars, params=params,
                       effects=_effects(body_eqns))

  b_scan = scan(pick(outer_carry, b_carry), [*pick(eqn.outvars, need), *stacked],
                pick(carry_in, b_carry), [*pick(body.outvars, need), *boundary], b_body)
  if not has_w:
    return b_scan, None
  w_scan = scan(pick(outer_carry, w_carry), pick(eqn.outvars, [not n for n in need]),
                pick(carry_in, w_carry), w_outs, w_body, stacked, boundary)
  return b_scan, w_scan


def _eval(closed: core.ClosedJaxpr, *args) -> list:
  """core.eval_jaxpr, except that a cast to varying (`pvary`) of a value already varying
  over those axes passes it on: the split jaxprs were traced with some residuals
  invariant, which the schedule's rings hold varying."""
  env: dict = {}
  read = lambda v: v.val if isinstance(v, core.Literal) else env[v]
  env.update(zip(closed.jaxpr.constvars, closed.consts))
  env.update(zip(closed.jaxpr.invars, args))
  for eqn in closed.jaxpr.eqns:
    ins = [read(v) for v in eqn.invars]
    if eqn.primitive.name == "pvary" and all(
        set(eqn.params["axes"]) <= set(jax.typeof(x).manual_axis_type.varying) for x in ins):
      outs = ins if eqn.primitive.multiple_results else ins[0]
    else:
      outs = eqn.primitive.bind(*ins, **eqn.primitive.get_bind_params(eqn.params))
    outs = outs if eqn.primitive.multiple_results else [outs]
    env.update(zip(eqn.outvars, outs))
  return [read(v) for v in closed.jaxpr.outvars]
