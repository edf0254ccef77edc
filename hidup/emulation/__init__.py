"""An emulated cluster on one Linux machine (`netns`: hosts as network namespaces, links limited
with tc); `python -m hidup.emulate` is its command."""
