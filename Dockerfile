# mptrain on a CUDA PyTorch base. Build and run (8 GPUs, one node):
#   docker build -t mptrain .
#   docker run --gpus all --ipc=host -v $PWD/outputs:/opt/mptrain/outputs mptrain parallel=fsdp precision=bf16 model=gpt-small
# NPROC sets the processes per node (default: every visible GPU).
FROM pytorch/pytorch:2.6.0-cuda12.4-cudnn9-runtime

WORKDIR /opt/mptrain
# Dependencies first, so code edits do not reinstall them.
COPY pyproject.toml README.md ./
COPY mptrain/__init__.py mptrain/__init__.py
RUN pip install --no-cache-dir -e ".[slurm,wandb,hf]"
COPY mptrain mptrain
COPY train.py ./

ENV NPROC=auto
ENTRYPOINT ["sh", "-c", "n=${NPROC}; [ \"$n\" = auto ] && n=$(python -c 'import torch; print(max(1, torch.cuda.device_count()))'); exec python -m mptrain.torchrun --standalone --nproc_per_node=$n train.py \"$@\"", "--"]
CMD ["parallel=fsdp", "precision=bf16"]
