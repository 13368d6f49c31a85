"""How a user installs a missing sm7x piece: the only place that spells it out.

The conda recipe patches the next line to ``PACKAGED_BY = "conda"`` so that an
installed package never suggests pip (mixing pip into a conda env breaks it).
"""

PACKAGED_BY = None

# Users install from a mirrored or local channel whose name we cannot know.
CHANNEL = "<channel>"


def install_hint(package: str) -> str:
    """One sentence telling the user how to install ``package`` (e.g. "sm7x-fa2-sm75")."""
    managers = f"`conda install -c {CHANNEL} {package}` (or mamba), or `pixi add {package}`"
    if PACKAGED_BY == "conda":
        return f"install {package} with {managers}"
    # Source checkout or pip install: the native libraries come from building the tree.
    return (
        f"rebuild sm7x from its source tree (`pip install .` in an sm7x checkout) "
        f"to get {package}, or install the conda package: {managers}"
    )
