"""EAGLE-3 heads shipped with the package, one folder per target file stem (spec.packaged_head).

`drafter.head: auto` reads the one `hetero-sd train-head` built on this machine
first, and one of these where none was built. Each folder holds the head in
EAGLE-3's layout with int8 matrices, and the report of the run that trained it.
"""
