"""ember: a graph compiler for training small neural networks.

The distribution's subpackages stand on floors (ARCHITECTURE.md): `ember.ir` <- `ember.passes`
<- `ember.codegen` <- `ember.runtime` <- `ember.frontends`, the user's entry point
(`from ember.frontends import compile, nn, optim`). This module holds only the version, so
`import ember` stays as cheap as the floor a program uses.
"""
__version__ = "0.1.0"
