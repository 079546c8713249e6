"""The `fsdp-train` and `fsdp-run` commands of an installed wheel: each runs the program of that
name built into the package (fsdpcpp/bin/), with the libraries of the torch this Python imports
on the loader's path, wherever pip put torch, the CUDA wheels beside it and this package."""
import importlib.util
import os
import sys


def _library_dirs():
    """torch/lib and each CUDA wheel's lib (nvidia/*/lib) where this Python finds them."""
    dirs = []
    torch = importlib.util.find_spec("torch")
    if torch is not None and torch.submodule_search_locations:
        dirs += [os.path.join(p, "lib") for p in torch.submodule_search_locations]
    nvidia = importlib.util.find_spec("nvidia")
    for root in (nvidia.submodule_search_locations or []) if nvidia is not None else []:
        dirs += sorted(os.path.join(root, d, "lib") for d in os.listdir(root)
                       if os.path.isdir(os.path.join(root, d, "lib")))
    return dirs


def _run(name):
    program = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bin", name)
    if not os.path.exists(program):
        sys.exit(f"{name}: {program} is missing: this fsdpcpp was installed without its programs "
                 "(pip install . from the repository builds them)")
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(_library_dirs() + [p for p in [env.get("LD_LIBRARY_PATH")] if p])
    env.setdefault("FSDP_PYTHON", sys.executable)  # fsdp-train's --tensorboard and --wandb writers: this python has fsdpcpp
    os.execve(program, [name] + sys.argv[1:], env)


def fsdp_train():
    _run("fsdp-train")


def fsdp_run():
    _run("fsdp-run")
