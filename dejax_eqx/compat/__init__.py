"""Drop-in layers for code written against other replay-buffer libraries.

- `dejax_eqx.compat.dejax`: the functional API of dejax 0.1.3
    (`import dejax_eqx.compat.dejax as dejax`).
"""
