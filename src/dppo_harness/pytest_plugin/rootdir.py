"""Give back pytest the rootdir it would have chosen had it known the harness's path options.

pytest picks its rootdir and config file from the arguments that exist as paths before any plugin
option is known, so `--evidence-dir DIR` (space form) with an existing DIR outside a project roots
the session at DIR without the project's config (no `addopts`, no `pythonpath`). `reroot` redoes the
rootdir-dependent part of pytest's `Config.parse` (pytest internals, checked against pytest 9.2); if
they are not as expected the session stops with one line asking for the `--opt=VALUE` form.
"""

from __future__ import annotations

import argparse
import copy
import inspect
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from _pytest.config.findpaths import ConfigDict

PATH_OPTIONS = ("--plan", "--evidence-dir", "--resume")


def misread_values(args: Sequence[str], invocation_dir: Path, options: Sequence[str] = PATH_OPTIONS) -> list[str]:
    """Values of `options` written as a separate argument that exist as paths (what pytest took
    for test paths while it chose the rootdir)."""
    out = []
    for i, arg in enumerate(args[:-1]):
        if arg in options and (invocation_dir / args[i + 1]).exists():
            out.append(args[i + 1])
    return out


def _determine_setup(
    config: pytest.Config, ns: argparse.Namespace
) -> tuple[Path, Path | None, ConfigDict, Sequence[str]]:
    # A pytest internal, imported only when a session must be re-rooted: a pytest without it fails only then.
    from _pytest.config.findpaths import determine_setup

    kwargs: dict[str, Any] = dict(
        inifile=ns.inifilename,
        args=ns.file_or_dir,
        rootdir_cmd_arg=ns.rootdir or None,
        invocation_dir=config.invocation_params.dir,
    )
    if "override_ini" in inspect.signature(determine_setup).parameters:
        kwargs["override_ini"] = ns.override_ini
    rootpath, inipath, inicfg, *rest = determine_setup(**kwargs)
    return rootpath, inipath, inicfg, (rest[0] if rest else [])


def reroot(config: pytest.Config, parser: pytest.Parser, args: list[str]) -> Path | None:
    """Re-root the session if a harness path option's value misled pytest; returns the new
    rootdir, or None when nothing had to change. `args` is pytest's own list (edited in place)."""
    misread = misread_values(args, config.invocation_params.dir)
    if not misread:
        return None
    ns = parser.parse_known_args(args, namespace=copy.copy(config.option))
    rootpath, inipath, inicfg, ignored = _determine_setup(config, ns)
    if (rootpath, inipath) == (config.rootpath, config.inipath):
        return None
    needed = (
        "_rootpath",
        "_inipath",
        "_inicfg",
        "_inicache",
        "_validate_args",
        "known_args_namespace",
        "_configure_python_path",
        "_unconfigure_python_path",
    )
    if not all(hasattr(config, a) for a in needed):
        raise pytest.UsageError(
            f"pytest took {misread[0]!r} (the value of a harness option) for a test path and rooted this session at "
            f"{config.rootpath}; write the option as --opt={misread[0]}"
        )
    old_addopts = list(config.getini("addopts")) if config.inipath is not None else []
    if old_addopts and args[: len(old_addopts)] == old_addopts:
        del args[: len(old_addopts)]
    config._unconfigure_python_path()  # the misread root's `pythonpath`, applied before any plugin loaded
    config._rootpath, config._inipath, config._inicfg = rootpath, inipath, inicfg
    if hasattr(config, "_ignored_config_files"):
        config._ignored_config_files = ignored
    config._inicache.clear()
    parser.extra_info["rootdir"] = str(rootpath)
    parser.extra_info["inifile"] = str(inipath)
    new_addopts = config._validate_args(list(config.getini("addopts")), "via addopts config")
    args[:0] = new_addopts
    config._configure_python_path()  # the real config file's `pythonpath` (test helpers' imports)
    config.pluginmanager.consider_preparse(new_addopts, exclude_only=False)
    user_confcutdir = ns.confcutdir
    config.known_args_namespace = parser.parse_known_args(args, namespace=copy.copy(config.option))
    if user_confcutdir is None:
        config.known_args_namespace.confcutdir = str(inipath.parent if inipath is not None else rootpath)
    return rootpath
