"""A real X11 window for the desktop environment's tests (python-xlib, which pyautogui already needs
on Linux): buttons at fixed places that report, one JSON line each on stdout, every mouse press and
release (button, which child window, root and window coordinates) and every key press (key name
and the character it types). Each button is filled with its colour, so a test can find it in a
screenshot. Prints {"ready": true} once mapped and focused.

    python x_window.py '{"size": [640, 480], "buttons": {"ok": [100, 80, 60, 30, [200, 30, 30]], ...}}'
"""

import json
import sys

from Xlib import X, XK, display


def main():
    spec = json.loads(sys.argv[1])
    d = display.Display()
    screen = d.screen()
    w, h = spec["size"]
    mask = X.ButtonPressMask | X.ButtonReleaseMask | X.KeyPressMask | X.ExposureMask | X.StructureNotifyMask
    top = screen.root.create_window(0, 0, w, h, 0, screen.root_depth, background_pixel=screen.white_pixel,
                                    event_mask=mask)
    names = {top.id: "background"}
    for name, (x, y, bw, bh, (r, g, b)) in spec["buttons"].items():
        colour = screen.default_colormap.alloc_color(r * 257, g * 257, b * 257).pixel
        child = top.create_window(x, y, bw, bh, 0, screen.root_depth, background_pixel=colour,
                                  event_mask=X.ButtonPressMask | X.ButtonReleaseMask)
        names[child.id] = name
    top.map_sub_windows()
    top.map()
    d.sync()
    while d.next_event().type != X.MapNotify:
        pass
    top.set_input_focus(X.RevertToParent, X.CurrentTime)
    d.sync()
    print(json.dumps({"ready": True}), flush=True)
    while True:
        e = d.next_event()
        if e.type in (X.ButtonPress, X.ButtonRelease):
            out = {"event": "press" if e.type == X.ButtonPress else "release", "button": e.detail,
                   "window": names.get(e.window.id, "?"), "root": [e.root_x, e.root_y], "at": [e.event_x, e.event_y]}
        elif e.type == X.KeyPress:
            shifted = bool(e.state & X.ShiftMask)
            keysym = d.keycode_to_keysym(e.detail, 1 if shifted else 0)
            out = {"event": "key", "name": _keysym_name(keysym), "char": XK.keysym_to_string(keysym),
                   "ctrl": bool(e.state & X.ControlMask)}
        else:
            continue
        print(json.dumps(out), flush=True)


def _keysym_name(keysym):
    for name in dir(XK):
        if name.startswith("XK_") and getattr(XK, name) == keysym:
            return name[3:]
    return str(keysym)


if __name__ == "__main__":
    main()
