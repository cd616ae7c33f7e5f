"""Stand-in modules for tests that need a foreign package's globals in a real torch.save pickle,
written into a temporary folder and imported only by the saving subprocess (module path -> source)."""

# What Lightning's omegaconf hyper-parameters pickle, in miniature.
OMEGACONF = {
    "omegaconf/__init__.py": "",
    "omegaconf/dictconfig.py": """
        class DictConfig:
            def __init__(self, content, metadata):
                self._content, self._metadata = content, metadata
        """,
    "omegaconf/listconfig.py": """
        class ListConfig:
            def __init__(self, content):
                self._content = content
        """,
    "omegaconf/base.py": """
        class ContainerMetadata:
            def __init__(self, **fields):
                self.__dict__.update(fields)
        class Metadata:
            def __init__(self, **fields):
                self.__dict__.update(fields)
        """,
    "omegaconf/nodes.py": """
        class _Node:
            def __init__(self, value):
                self._val = value
        class AnyNode(_Node): pass
        class StringNode(_Node): pass
        class IntegerNode(_Node): pass
        class FloatNode(_Node): pass
        class BooleanNode(_Node): pass
        """,
}
