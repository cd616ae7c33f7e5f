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

# What transformers' Trainer pickles into training_args.bin (torch.save(self.args)), in miniature:
# a dataclass instance with the library's enums and a nested dataclass among its fields.
TRANSFORMERS = {
    "transformers/__init__.py": "",
    "transformers/trainer_utils.py": """
        import enum
        class ExplicitEnum(str, enum.Enum):
            pass
        class IntervalStrategy(ExplicitEnum):
            NO = "no"
            STEPS = "steps"
            EPOCH = "epoch"
        class SchedulerType(ExplicitEnum):
            LINEAR = "linear"
            COSINE = "cosine"
        """,
    "transformers/trainer_pt_utils.py": """
        import dataclasses
        @dataclasses.dataclass
        class AcceleratorConfig:
            split_batches: bool = False
            dispatch_batches: object = None
        """,
    "transformers/training_args.py": """
        import dataclasses
        from transformers.trainer_utils import ExplicitEnum, IntervalStrategy, SchedulerType
        from transformers.trainer_pt_utils import AcceleratorConfig
        class OptimizerNames(ExplicitEnum):
            ADAMW_TORCH = "adamw_torch"
            SGD = "sgd"
        @dataclasses.dataclass
        class TrainingArguments:
            output_dir: str = "out"
            learning_rate: float = 5e-5
            num_train_epochs: float = 3.0
            max_steps: int = -1
            per_device_train_batch_size: int = 8
            gradient_accumulation_steps: int = 1
            lr_scheduler_type: SchedulerType = SchedulerType.LINEAR
            save_strategy: IntervalStrategy = IntervalStrategy.STEPS
            optim: OptimizerNames = OptimizerNames.ADAMW_TORCH
            seed: int = 42
            accelerator_config: AcceleratorConfig = dataclasses.field(default_factory=AcceleratorConfig)
        """,
}
