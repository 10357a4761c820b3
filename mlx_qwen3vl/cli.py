"""What the package's command lines share: bad input ends in one `error: ...` line on stderr and
exit status 2 (argparse's mistakes too), Ctrl-C in 130, and values are checked, under the flag
the user typed, before any model loads."""

import argparse
import sys

from .errors import Qwen3VLError

# API argument → the flag every command line spells it with.
FLAGS = {"min_pixels": "--min-pixels", "max_pixels": "--max-pixels", "fps": "--fps", "source_fps": "--source-fps",
         "max_tokens": "--max-tokens"}


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not argparse's usage block
        self.exit(2, f"error: {message} (see --help)\n")


def run(body, interrupted: str = None) -> int:
    """body() → its exit status; a Qwen3VLError becomes one `error: ...` line and status 2, Ctrl-C
    status 130 (after the line `interrupted`, when given)."""
    try:
        return body()
    except Qwen3VLError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if interrupted:
            print(interrupted, file=sys.stderr)
        return 130


def check_media_flags(model_path, min_pixels=None, max_pixels=None, fps=None, source_fps=None):
    """--min-pixels / --max-pixels against the checkpoint's preprocessor config, --fps and
    --source-fps, as the processor would check them, but named as flags and before the model loads."""
    from .processor import image_budget, read_media_configs
    from .video import check_fps

    image_config, _ = read_media_configs(model_path)
    image_budget(image_config, min_pixels, max_pixels, names=FLAGS)
    check_fps(fps, FLAGS["fps"])
    check_fps(source_fps, FLAGS["source_fps"])


def check_max_tokens(value):
    from .sampling import check_sampling

    check_sampling({"max_tokens": value}, name=FLAGS.get)
