"""The interface every agent environment implements, and the one mapping from a screenshot's pixels
to the environment's input coordinates.

An environment shows the model an `Observation` (the image exactly as the model sees it, plus how
its pixels sit in the environment's input space) and executes `ComputerAction`s whose points are in
that image's pixels. `to_env` is the only place the two spaces meet: a Retina capture is in pixels
while input is in points (scale 0.5), a downscaled capture has scale > 1, a crop of a page or
screen has an origin.
"""

import abc
import math
from dataclasses import dataclass
from typing import Tuple

from ...errors import InputError
from ..computer_tools import ComputerAction


@dataclass
class Observation:
    """What the model sees. image: RGB PIL image (orientation applied). scale: environment input
    units per image pixel, x and y. origin: environment coordinates of the image's pixel (0, 0)."""

    image: "PIL.Image.Image"  # noqa: F821 (PIL is imported by whoever makes one)
    scale: Tuple[float, float] = (1.0, 1.0)
    origin: Tuple[float, float] = (0.0, 0.0)

    @property
    def size(self) -> Tuple[int, int]:
        return self.image.size


def to_env(point, obs: Observation) -> Tuple[float, float]:
    """A point in `obs.image`'s pixels → the environment's input coordinates: origin + point * scale."""
    x, y = point
    return (obs.origin[0] + x * obs.scale[0], obs.origin[1] + y * obs.scale[1])


def to_env_pixel(point, obs: Observation) -> Tuple[int, int]:
    """A point in `obs.image`'s pixels → the integer input coordinate (CSS pixel, screen point) whose
    area holds that pixel's centre: floor(to_env(point + 0.5)). Integer inputs (X11, a browser's hit
    test, which rounds fractional CSS positions) then act inside the very pixel the model meant."""
    ex, ey = to_env((point[0] + 0.5, point[1] + 0.5), obs)
    return math.floor(ex), math.floor(ey)



def input_pixel(point, obs: Observation) -> Tuple[int, int]:
    """to_env_pixel for a point an environment is asked to act at; InputError outside `obs.image`
    (a point past the screenshot is on no screen the model saw)."""
    x, y = point
    if not (0 <= x < obs.image.width and 0 <= y < obs.image.height):
        raise InputError(f"point ({x}, {y}) is outside the {obs.image.width}x{obs.image.height} screenshot")
    return to_env_pixel(point, obs)

class Environment(abc.ABC):
    """A place an agent acts. reset() gives the first screenshot and the task text; act() executes a
    ComputerAction whose points are in the last Observation's image pixels (mapped with to_env)."""

    name: str = "environment"

    @abc.abstractmethod
    def reset(self) -> Tuple[Observation, str]:
        """Start an episode: the first screenshot and the task text."""

    @abc.abstractmethod
    def screenshot(self) -> Observation:
        """The screen now."""

    @abc.abstractmethod
    def act(self, action: ComputerAction) -> None:
        """Execute `action` (points in the last Observation's image pixels)."""

    @property
    def done(self) -> bool:
        """The environment says the episode ended (MiniWoB++: the task is done)."""
        return False

    @property
    def reward(self) -> float:
        """The environment's reward so far (0.0 where it does not score)."""
        return 0.0

    def close(self) -> None:
        """Release what the environment holds (browser, windows)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
