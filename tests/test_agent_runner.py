"""The agent runner: the Environment interface and its one coordinate mapping, run_task on
scripted checkpoints, trajectories, replay, the command line and evaluation, in real MiniWoB++
episodes in headless Chromium."""

import pytest
from PIL import Image

from mlx_qwen3vl.agent.computer_tools import ComputerAction
from mlx_qwen3vl.agent.envs import Environment, Observation, env_class, to_env


def test_to_env_maps_image_pixels_by_origin_and_scale():
    img = Image.new("RGB", (200, 100))
    assert to_env((10, 20), Observation(img)) == (10, 20)
    # Retina: a 2x capture in pixels, input in points
    assert to_env((301, 99), Observation(img, scale=(0.5, 0.5))) == (150.5, 49.5)
    # a downscaled capture of a region of a larger screen, scaled differently on each axis
    assert to_env((10, 20), Observation(img, scale=(2.0, 1.5), origin=(100, 40))) == (120.0, 70.0)
    assert to_env((0, 0), Observation(img, scale=(3.0, 3.0), origin=(7, 9))) == (7, 9)


def test_environment_is_abstract_and_defaults_to_no_score():
    with pytest.raises(TypeError):
        Environment()

    class Still(Environment):
        name = "still"

        def __init__(self):
            self.acts, self.closed = [], False

        def reset(self):
            return self.screenshot(), "nothing"

        def screenshot(self):
            return Observation(Image.new("RGB", (4, 4)))

        def act(self, action):
            self.acts.append(action)

        def close(self):
            self.closed = True

    with Still() as env:
        obs, task = env.reset()
        env.act(ComputerAction("click", (1, 2)))
        assert (task, obs.size, env.done, env.reward, env.acts) == ("nothing", (4, 4), False, 0.0,
                                                                   [ComputerAction("click", (1, 2))])
    assert env.closed


def test_env_class_names_unknown_environment():
    with pytest.raises(KeyError):
        env_class("nowhere")
