"""Constants that differ between jobs, lifted into operands: the sweep users write is one program.

``optax.adam(lr)`` bakes ``lr`` into the traced step as a literal, so N learning rates are N
programs that can neither share an executable nor fuse. Here a step's jaxpr is read as data:

* its *skeleton* is the jaxpr with every scalar numeric literal blanked (structure, primitives,
  shapes, parameters, data flow; values of the top-level constants blanked too). Two jobs whose
  skeletons are equal compute the same thing up to the values of those literals. A constant
  that decides a shape or Python control flow changed the trace itself, so it shows up in the
  skeleton: such jobs never match and stay compile-time programs of their own;
* its *sites* are those literals, in one deterministic walk order (sub-jaxprs included);
* a *lifted* step evaluates the reference job's jaxpr with the chosen sites read from extra
  operands, which the runtime carries as trailing state arrays of each job (so a fused group
  stacks every member's constants like its state, and a step passes them through unchanged).

Sub-jaxprs: calls (``jit``/``pjit``, ``closed_call``, ``custom_jvp_call``, ``custom_vjp_call``,
``remat``) are inlined when they hold a lifted site (only the forward step is ever evaluated, so
a custom rule's primal body is what runs); ``cond``, ``while`` and ``scan`` are rebuilt with
``lax`` around evaluators that close over the lifted values. A lifted site under any other
higher-order primitive is refused (:class:`NotLiftable`), and those jobs keep their own program.

Numerics: a lifted program runs the same operations on the same values, but XLA can no longer
fold or strength-reduce a constant it does not see, so it is not promised bit-identical to the
literal program (docs/explanation/fusion.md). The runtime lifts only for fused groups, whose members
are already within a tolerance of their unfused runs; unfused jobs keep their exact programs.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from typing import Any, Callable

import jax
import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal

from ..._errors import XShareError

# Call-like primitives whose sub-jaxpr is the computation itself (param name of the jaxpr).
_CALLS = {"pjit": "jaxpr", "jit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr",
          "custom_jvp_call": "call_jaxpr", "custom_vjp_call": "call_jaxpr",
          "custom_vjp_call_jaxpr": "fun_jaxpr", "remat": "jaxpr", "checkpoint": "jaxpr",
          "remat2": "jaxpr"}
_REBUILT = ("cond", "while", "scan")
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


class NotLiftable(XShareError):
    """A differing constant sits where it cannot become an operand; the message says where."""


@dataclass(eq=False)
class Traced:
    """One job's step read as data."""

    closed: ClosedJaxpr
    skeleton: str                         # hex digest: equal skeletons differ only in sites' values
    values: list                          # each site's value (numpy), in walk order
    sites: list                           # (eqn, operand index) or ("const", i), in walk order
    where: list                           # each site's primitive, for messages
    holders: dict = field(default_factory=dict)   # id(eqn) -> set of site indices under it

    def differing(self, other: "Traced") -> list[int]:
        """Sites whose values differ (bitwise: -0.0 and NaN payloads count)."""
        return [i for i, (a, b) in enumerate(zip(self.values, other.values))
                if a.dtype != b.dtype or a.tobytes() != b.tobytes()]


def trace(closed: ClosedJaxpr) -> Traced:
    """Read ``closed`` (the jaxpr of a job's flat step) into its skeleton and sites."""
    tokens: list[str] = []
    sites: list = []
    values: list = []
    where: list = []
    holders: dict = {}
    for i, c in enumerate(closed.consts):
        arr = np.asarray(c)
        tokens.append(f"const {i} {arr.dtype}{list(arr.shape)}")
        sites.append(("const", i))
        values.append(arr)
        where.append("a constant array")
    _walk(closed.jaxpr, tokens, sites, values, where, holders, [])
    digest = hashlib.sha256("\n".join(tokens).encode()).hexdigest()
    return Traced(closed, digest, values, sites, where, holders)


def _liftable(lit: Any) -> bool:
    aval = lit.aval
    dtype = getattr(aval, "dtype", None)
    return (getattr(aval, "shape", None) == () and dtype is not None and dtype != np.bool_
            and jax.numpy.issubdtype(dtype, jax.numpy.number))


def _sub_jaxprs(value: Any) -> list | None:
    if isinstance(value, (ClosedJaxpr, Jaxpr)):
        return [value]
    if isinstance(value, (tuple, list)) and value and all(isinstance(v, (ClosedJaxpr, Jaxpr)) for v in value):
        return list(value)
    return None


def _aval(v: Any) -> str:
    aval = v.aval
    return aval.str_short() if hasattr(aval, "str_short") else str(aval)


def _walk(jaxpr: Jaxpr, tokens: list, sites: list, values: list, where: list, holders: dict,
          stack: list) -> None:
    names: dict[int, int] = {}

    def name(v: Any) -> str:
        return str(names.setdefault(id(v), len(names)))

    v: Any  # a Var here, a Var or a Literal below
    for v in list(jaxpr.constvars) + list(jaxpr.invars):
        tokens.append(f"in {name(v)}:{_aval(v)}")
    for eqn in jaxpr.eqns:
        args = []
        for i, v in enumerate(eqn.invars):
            if isinstance(v, Literal):
                if _liftable(v):
                    index = len(sites)
                    sites.append((eqn, i))
                    # (a Literal's aval is a ShapedArray; jax annotates it as the AbstractValue base)
                    values.append(np.asarray(v.val, dtype=v.aval.dtype))  # type: ignore[attr-defined]
                    where.append(eqn.primitive.name)
                    for holder in stack:
                        holders.setdefault(holder, set()).add(index)
                    args.append(f"L:{_aval(v)}")
                else:
                    args.append(f"K{v.val!r}:{_aval(v)}")
            else:
                args.append(name(v))
        params = []
        stack.append(id(eqn))
        for key in sorted(eqn.params):
            value = eqn.params[key]
            subs = _sub_jaxprs(value)
            if subs is None:
                params.append(f"{key}={_ADDRESS.sub('', repr(value))}")
                continue
            for sub in subs:
                tokens.append(f"[{key}")
                if isinstance(sub, ClosedJaxpr):
                    # Consts of an inner closed jaxpr are not lifted: their values are part of
                    # the skeleton, so jobs that differ there never share a lifted program.
                    for c in sub.consts:
                        arr = np.asarray(c)
                        tokens.append(f"inner const {arr.dtype}{list(arr.shape)} "
                                      f"{hashlib.sha256(arr.tobytes()).hexdigest()}")
                    sub = sub.jaxpr
                _walk(sub, tokens, sites, values, where, holders, stack)
                tokens.append("]")
        stack.pop()
        outs = " ".join(f"{name(v)}:{_aval(v)}" for v in eqn.outvars)
        tokens.append(f"{outs} = {eqn.primitive.name}[{', '.join(params)}] {' '.join(args)}")
    tokens.append("out " + " ".join(f"K{v.val!r}" if isinstance(v, Literal) else name(v)
                                    for v in jaxpr.outvars))


def lifted_step(ref: Traced, positions: list[int], n_state: int) -> Callable:
    """The step of ``ref``'s jaxpr over (state arrays + one operand per lifted site, batch
    arrays) -> (new state arrays + the operands unchanged, metrics vector)."""
    positions = list(positions)
    for p in positions:
        site = ref.sites[p]
        if site[0] == "const":
            continue
        outer = [h for h, under in ref.holders.items() if p in under]
        for eqn in _eqns_by_id(ref.closed.jaxpr, set(outer)):
            name = eqn.primitive.name
            if name == "scan" and "num_consts" not in eqn.params:
                # jax >= 0.12 describes scan operands by flat trees (and forwards loop-invariant
                # carries as consts); rebuilding that is not supported yet
                raise NotLiftable(f"a differing constant sits inside 'scan' ({ref.where[p]}), which this "
                                  f"jax ({jax.__version__}) does not let xshare rebuild with the "
                                  "constant as an operand")
            if name not in _CALLS and name not in _REBUILT:
                raise NotLiftable(f"a differing constant sits inside {name!r} ({ref.where[p]}), which "
                                  "xshare cannot rebuild with the constant as an operand")
    closed = ref.closed

    def step(state_plus: list, batch: list):
        state, lifted = list(state_plus[:n_state]), list(state_plus[n_state:])
        subst: dict = {}
        consts = list(closed.consts)
        for p, value in zip(positions, lifted):
            site = ref.sites[p]
            if site[0] == "const":
                consts[site[1]] = value
            else:
                subst[(id(site[0]), site[1])] = value
        holders = {h for h, under in ref.holders.items() if under & set(positions)}
        outs = _eval(closed.jaxpr, consts, state + list(batch), subst, holders)
        return list(outs[:n_state]) + lifted, outs[n_state]

    return step


def _eqns_by_id(jaxpr: Jaxpr, ids: set) -> list:
    found = []

    def visit(j: Jaxpr) -> None:
        for eqn in j.eqns:
            if id(eqn) in ids:
                found.append(eqn)
            for value in eqn.params.values():
                for sub in _sub_jaxprs(value) or ():
                    visit(sub.jaxpr if isinstance(sub, ClosedJaxpr) else sub)

    visit(jaxpr)
    return found


def _eval(jaxpr: Jaxpr, consts: list, args: list, subst: dict, holders: set) -> list:
    """``jax.core.eval_jaxpr`` with lifted literals read from ``subst`` and the sub-jaxprs that
    hold one (``holders``) inlined or rebuilt."""
    env: dict = {}

    def read(v: Any) -> Any:
        return v.val if isinstance(v, Literal) else env[v]

    for v, x in zip(jaxpr.constvars, consts):
        env[v] = x
    for v, x in zip(jaxpr.invars, args):
        env[v] = x
    for eqn in jaxpr.eqns:
        invals = [subst.get((id(eqn), i), None) if (id(eqn), i) in subst else read(v)
                  for i, v in enumerate(eqn.invars)]
        if id(eqn) in holders:
            outs = _rebuild(eqn, invals, subst, holders)
        else:
            bound = eqn.primitive.get_bind_params(eqn.params)
            # (older jax returns (subfuns, params); jax 0.10+ returns the params alone)
            subfuns, params = bound if isinstance(bound, tuple) else ((), bound)
            with eqn.ctx.manager:
                outs = eqn.primitive.bind(*subfuns, *invals, **params)
            if not eqn.primitive.multiple_results:
                outs = [outs]
        for v, x in zip(eqn.outvars, outs):
            env[v] = x
    return [read(v) for v in jaxpr.outvars]


def _closed_eval(sub: Any, subst: dict, holders: set) -> Callable:
    if isinstance(sub, ClosedJaxpr):
        return lambda *xs: _eval(sub.jaxpr, list(sub.consts), list(xs), subst, holders)
    return lambda *xs: _eval(sub, [], list(xs), subst, holders)


def _rebuild(eqn: Any, invals: list, subst: dict, holders: set) -> list:
    name, p = eqn.primitive.name, eqn.params
    if name in _CALLS:
        return _closed_eval(p[_CALLS[name]], subst, holders)(*invals)
    if name == "cond":
        branches = [_closed_eval(b, subst, holders) for b in p["branches"]]
        index, ops = invals[0], invals[1:]
        return list(jax.lax.switch(index, [lambda *o, f=f: tuple(f(*o)) for f in branches], *ops))
    if name == "while":
        nc, nb = p["cond_nconsts"], p["body_nconsts"]
        cconsts, bconsts, init = invals[:nc], invals[nc:nc + nb], invals[nc + nb:]
        cond = _closed_eval(p["cond_jaxpr"], subst, holders)
        body = _closed_eval(p["body_jaxpr"], subst, holders)
        return list(jax.lax.while_loop(lambda c: cond(*cconsts, *c)[0],
                                       lambda c: tuple(body(*bconsts, *c)), tuple(init)))
    if name == "scan":
        nc, ncarry = p["num_consts"], p["num_carry"]
        consts, init, xs = invals[:nc], invals[nc:nc + ncarry], invals[nc + ncarry:]
        body = _closed_eval(p["jaxpr"], subst, holders)

        def f(carry, x):
            outs = body(*consts, *carry, *x)
            return tuple(outs[:ncarry]), tuple(outs[ncarry:])

        carry, ys = jax.lax.scan(f, tuple(init), tuple(xs) if xs else None, length=p["length"],
                                 reverse=p["reverse"], unroll=p["unroll"])
        return list(carry) + list(ys)
    raise NotLiftable(f"a differing constant sits inside {name!r}")  # lifted_step checks first
