"""Calls from a compiled layer into separately compiled kernels, by symbol, without linking their code in.

Numba links the LLVM module of every kernel a function calls into that function's own, then runs
LLVM's whole module pipeline and code generation over all of it again. A decoder layer's own code
is a few dozen calls, but its build took ~11 s (Zen 3): LLVM re-optimizing and re-compiling the
weight products and attention kernels it calls, which were compiled and cached already.

`call(...)` binds a kernel so that a caller's code declares it as an external symbol and calls it
there, with Numba's calling convention, as Numba's own calls do; the symbol is registered with LLVM
(`llvmlite.binding.add_symbol`) as the address of the kernel compiled for the call's argument types.
The kernel is named by a `Recipe` (module, attribute, factory arguments), so a process that loads
the caller from Numba's cache can find it again: the call adds a `Preload` to the caller's reload
hooks, which Numba runs before it loads the caller's code, and which compiles or loads the kernel
and registers its symbol. The machine code of each kernel is the same as when linked, so results
are the same bits; the call is one indirect jump more per kernel (a layer calls about ten).

Only for functions called from Python: a function that links such a caller in and is then cached
would need the hooks too, and Numba does not carry a cached library's hooks on to its callers.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect

import llvmlite.binding as llvm
from numba.core import cgutils, types
from numba.extending import intrinsic


class Recipe:
    """How any process finds one kernel: module attribute `name`, called with `args` if given, then `[item]`."""

    def __init__(self, module: str, name: str, args: tuple | None = None, item: int | None = None):
        self.module, self.name, self.args, self.item = module, name, args, item

    def key(self) -> tuple:
        return self.module, self.name, self.args, self.item

    def __eq__(self, other) -> bool:
        return isinstance(other, Recipe) and other.key() == self.key()

    def __hash__(self) -> int:
        return hash(self.key())

    def dispatcher(self):
        found = getattr(importlib.import_module(self.module), self.name)
        if self.args is not None:
            found = found(*self.args)
        return found if self.item is None else found[self.item]


def symbol(recipe: Recipe, argtys: tuple) -> str:
    """The kernel's symbol for these argument types, the same in every process."""
    text = repr((recipe.key(), tuple(repr(t) for t in argtys)))
    return "speculant_unlinked_" + hashlib.sha256(text.encode()).hexdigest()[:32]


def register(recipe: Recipe, argtys: tuple):
    """Compile (or load) the kernel for argtys and register its symbol; its CompileResult."""
    kernel = recipe.dispatcher()
    kernel.compile(argtys)
    compiled = kernel.overloads[argtys]
    address = compiled.library.get_pointer_to_function(compiled.fndesc.llvm_func_name)
    if not address:
        raise RuntimeError(f"{recipe.key()}: no machine code for {compiled.fndesc.llvm_func_name}")
    llvm.add_symbol(symbol(recipe, argtys), address)
    return compiled


class Preload:
    """A reload hook (pickled with its caller in Numba's cache): registers one kernel's symbol."""

    def __init__(self, recipe: Recipe, argtys: tuple):
        self.recipe, self.argtys = recipe, argtys

    def __eq__(self, other) -> bool:
        return isinstance(other, Preload) and (other.recipe, other.argtys) == (self.recipe, self.argtys)

    def __hash__(self) -> int:
        return hash((self.recipe, self.argtys))

    def __call__(self) -> None:
        register(self.recipe, self.argtys)


def _typer(recipe: Recipe, args: tuple):
    argtys = tuple(types.unliteral(a) for a in args)
    fndesc = register(recipe, argtys).fndesc

    def codegen(context, builder, sig, llargs):
        fnty = context.call_conv.get_function_type(fndesc.restype, fndesc.argtypes)
        fn = cgutils.get_or_insert_function(builder.module, fnty, symbol(recipe, argtys))
        context.call_conv.decorate_function(fn, fndesc.args, fndesc.argtypes, noalias=fndesc.noalias)
        status, result = context.call_conv.call_function(builder, fn, fndesc.restype, fndesc.argtypes, llargs)
        with cgutils.if_unlikely(builder, status.is_error):
            context.call_conv.return_status_propagate(builder, status)
        context.active_code_library._reload_init.add(Preload(recipe, argtys))
        return result

    return fndesc.restype(*argtys), codegen


def call(module: str, name: str, args: tuple | None = None, item: int | None = None):
    """The kernel `Recipe(module, name, args, item)` names, as a function compiled code calls by symbol."""
    recipe = Recipe(module, name, args, item)
    params = ", ".join(f"a{i}" for i in range(len(inspect.signature(recipe.dispatcher().py_func).parameters)))
    scope: dict = {}
    exec(f"def {name}_unlinked(typingctx, {params}):\n    return typer(recipe, ({params},))",  # noqa: S102
         {"typer": _typer, "recipe": recipe}, scope)
    bound = intrinsic(scope[f"{name}_unlinked"])
    bound.unlinked_recipe = recipe
    return bound


def called_kernel(fnty):
    """The kernel a Numba function type calls by symbol (a `call(...)`'s type), else None."""
    templates = getattr(fnty, "templates", ())
    recipe = getattr(getattr(templates[0], "key", None), "unlinked_recipe", None) if templates else None
    return None if recipe is None else recipe.dispatcher()
