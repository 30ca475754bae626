# envs.py picks MuJoCo's OpenGL backend (MUJOCO_GL), which mujoco fixes when it is first imported: import
# envs before any test module can import mujoco, so the pixel worlds can render whatever runs first.
import envs  # noqa: F401
