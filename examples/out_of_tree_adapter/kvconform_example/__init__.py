"""An out-of-tree kvconform adapter: the reference engine under another name."""
