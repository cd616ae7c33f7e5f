"""Lightning: ``ModelCheckpoint``'s default ``.ckpt`` from a real 2-process DDP run on CPU, hyper-parameters saved.

Imported only inside the frameworks venv (see README.md beside this file). ``write`` runs this file as a script
(``python fw_lightning.py train OUT``): Lightning's ``strategy="ddp"`` starts the second rank by running the same
command again, so the Trainer must live in a script, not in the driver's process.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys
from pathlib import Path

SEED = 0
FEATURES, HIDDEN, CLASSES = 8, 16, 3
SAMPLES, BATCH = 64, 8  # 4 steps per epoch on each of the 2 ranks


def lightning_module_class():
    """The LightningModule, built on demand so that importing this file stays cheap."""
    import lightning as L
    import torch
    from torch import nn
    from torch.nn import functional as F

    class TinyClassifier(L.LightningModule):
        """An MLP under ``self.model`` (Lightning's ``model.`` key prefix), with its hyper-parameters saved."""

        def __init__(self, features: int = FEATURES, hidden: int = HIDDEN, classes: int = CLASSES,
                     lr: float = 0.05, data_dir: Path = Path("/data/tiny"), tags: tuple = ("tiny", "ddp")) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.model = nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.BatchNorm1d(hidden),
                                       nn.Linear(hidden, classes))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.model(x)

        def training_step(self, batch, batch_index):  # noqa: ANN001, ANN201
            x, y = batch
            loss = F.cross_entropy(self(x), y)
            self.log("train_loss", loss, sync_dist=True)
            return loss

        def validation_step(self, batch, batch_index):  # noqa: ANN001, ANN201
            x, y = batch
            self.log("val_loss", F.cross_entropy(self(x), y), sync_dist=True)

        def configure_optimizers(self):  # noqa: ANN201
            optimizer = torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
            scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
            return {"optimizer": optimizer, "lr_scheduler": scheduler}

    return TinyClassifier


def data():
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    generator = torch.Generator().manual_seed(SEED)
    x = torch.randn(SAMPLES, FEATURES, generator=generator)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    dataset = TensorDataset(x, y)
    return DataLoader(dataset, batch_size=BATCH), DataLoader(dataset, batch_size=BATCH)


def train(out: Path) -> None:
    """The DDP run (both ranks run this): 2 epochs, the default ModelCheckpoint plus a weights-only one."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    L.seed_everything(SEED, workers=True)
    model = lightning_module_class()()
    train_loader, val_loader = data()
    weights_only = ModelCheckpoint(dirpath=out / "weights_only", filename="weights-{epoch}", save_weights_only=True,
                                   monitor="val_loss", save_last=False)
    trainer = L.Trainer(strategy="ddp", accelerator="cpu", devices=2, max_epochs=2, default_root_dir=out,
                        callbacks=[ModelCheckpoint(), weights_only], logger=L.pytorch.loggers.CSVLogger(out),
                        enable_progress_bar=False, enable_model_summary=False, deterministic=True)
    trainer.fit(model, train_loader, val_loader)


def write(out: Path) -> list[dict]:
    subprocess.run([sys.executable, str(Path(__file__).resolve()), "train", str(out)], check=True, cwd=out)
    default = sorted((out / "lightning_logs" / "version_0" / "checkpoints").glob("*.ckpt"))
    weights = sorted((out / "weights_only").glob("*.ckpt"))
    if len(default) != 1 or len(weights) != 1:
        raise RuntimeError(f"expected one checkpoint from each ModelCheckpoint, found {default} and {weights}")
    return [
        {"id": "ddp-modelcheckpoint", "path": str(default[0].relative_to(out)), "allow_globals": [],
         "load_back": "load_from_checkpoint", "fixture": True,
         "about": "ModelCheckpoint() default .ckpt after 2 epochs of DDP on 2 CPU processes: state_dict with "
                  "'model.' keys, save_hyperparameters (a PosixPath, a tuple), Adam + StepLR, loops, callbacks "
                  "(ModelCheckpoint's dirpath)"},
        {"id": "ddp-weights-only", "path": str(weights[0].relative_to(out)), "allow_globals": [],
         "load_back": "load_from_checkpoint", "fixture": True,
         "about": "ModelCheckpoint(save_weights_only=True, monitor='val_loss'): no optimizer or loops"},
    ]


# ---------------------------------------------------------------------------------------------- load back


def load_back(case: dict, outputs: dict[str, str]) -> str:
    import torch
    from lightning.fabric.utilities.cloud_io import _load as lightning_load

    module_class = lightning_module_class()

    def lightning_loads(path: str):  # noqa: ANN202
        """Lightning's own loader, under torch's weights_only unpickler with the one global a default
        ModelCheckpoint file needs beyond it (its dirpath, and the data_dir hyper-parameter, are PosixPaths)."""
        with torch.serialization.safe_globals([pathlib.PosixPath]):
            return module_class.load_from_checkpoint(path, map_location="cpu", weights_only=True)

    original = lightning_loads(outputs["input"]).eval()
    expected = original.state_dict()
    probe = torch.randn(5, FEATURES, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected_logits = original(probe)
    checked = []

    def same(model: torch.nn.Module, what: str) -> None:
        """Equal weights and logits to the original; a bare module's keys lack the LightningModule's 'model.'."""
        model.eval()
        prefix = "" if isinstance(model, module_class) else "model."
        got = {prefix + key: tensor for key, tensor in model.state_dict().items()}
        if set(got) != set(expected):
            raise AssertionError(f"{what}: keys {sorted(set(got) ^ set(expected))[:4]} differ")
        for key, tensor in got.items():
            if not torch.equal(tensor, expected[key]):
                raise AssertionError(f"{what}: {key} differs from the original")
        with torch.no_grad():
            if not torch.equal(model(probe), expected_logits):
                raise AssertionError(f"{what}: logits differ from the original's")
        checked.append(what)

    # the full-checkpoint .pt outputs: Lightning's own loader, hyper-parameters from the file
    for name in ("remap", "pt"):
        if name in outputs:
            model = lightning_loads(outputs[name])
            if dict(model.hparams) != dict(original.hparams):
                raise AssertionError(f"{name}: hparams {dict(model.hparams)} != {dict(original.hparams)}")
            same(model, f"load_from_checkpoint({name})")
    # strip: 'model.' gone, the bare nn.Module takes the weights as they are
    if "strip" not in outputs:
        raise AssertionError("no strip output")
    with torch.serialization.safe_globals([pathlib.PosixPath]):
        stripped = lightning_load(outputs["strip"], map_location="cpu", weights_only=True)
    state_dict = stripped["state_dict"] if "state_dict" in stripped else stripped
    bare = module_class(**original.hparams).model
    bare.load_state_dict(state_dict, strict=True)
    same(bare, "nn.Module.load_state_dict(strip)")
    # the safetensors output: the LightningModule's own keys
    if "safetensors" in outputs:
        from safetensors.torch import load_file

        model = module_class(**original.hparams)
        model.load_state_dict(load_file(outputs["safetensors"]), strict=True)
        same(model, "load_state_dict(safetensors)")
    return "equal weights and logits: " + ", ".join(checked)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "train":
        train(Path(sys.argv[2]))
    else:
        sys.exit("usage: python fw_lightning.py train OUT_DIR")
