"""Environments an agent acts in (see base.py for the interface). Each concrete environment imports
its optional dependency (selenium, miniwob, mss, pyautogui) itself, so it is imported by name:
`load_env("miniwob")`, or `mlx_qwen3vl.agent.envs.miniwob` directly."""

import importlib

from .base import Environment, Observation, to_env, to_env_pixel

# name → (module, class): imported only when asked, their dependencies being optional
ENVIRONMENTS = {"miniwob": ("miniwob", "MiniWoBEnv"), "browser": ("browser", "BrowserEnv"),
                "desktop": ("desktop", "DesktopEnv")}


def env_class(name: str):
    """The Environment class called `name` (ENVIRONMENTS), imported now."""
    module, cls = ENVIRONMENTS[name]
    return getattr(importlib.import_module(f"{__name__}.{module}"), cls)


__all__ = ["Environment", "Observation", "to_env", "to_env_pixel", "ENVIRONMENTS", "env_class"]
