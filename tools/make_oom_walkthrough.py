"""Writes notebooks/oom_walkthrough.ipynb (run: python tools/make_oom_walkthrough.py)."""
import nbformat
from nbformat.v4 import new_code_cell as code, new_markdown_cell as md, new_notebook
from seed_model import SEED_MODEL

cells = [
    md("# Why did my notebook run out of memory?\n\n"
       "A Colab user's training loop died in `optimizer.step()` with\n\n"
       "```\nRuntimeError: CUDA out of memory. Tried to allocate 2.32 GiB (GPU 0; 15.78 GiB total capacity;\n"
       "11.91 GiB already allocated; 182.75 MiB free; 14.26 GiB reserved in total by PyTorch)\n```\n\n"
       "and they had pasted `!nvidia-smi | grep MiB` after each of 13 lines to find out where the memory went. "
       "This notebook replays that story at CPU scale (it runs anywhere; on a GPU set `device = 'cuda'`): "
       "forward keeps activations for backward, backward adds gradients as large as the weights, Adam adds "
       "two buffers per weight, and the previous iteration's `output` and `loss` still hold a graph. "
       "It ends in a real out-of-memory error and the panel that explains it."),
    code("%load_ext ipy_gpumem"),
    code("import torch\n"
         "device = 'cuda' if torch.cuda.is_available() else 'cpu'\n"
         "torch.manual_seed(0)\n"
         + SEED_MODEL),
    md("## One training step, line by line\nThe replacement for `check 6` ... `check 11`: each line's own delta and peak."),
    code("%%gpumem --lines\n"
         "output = model(inputs)\n"
         "loss = torch.nn.functional.cross_entropy(output, targets)\n"
         "optimizer.zero_grad()\n"
         "loss.backward()\n"
         "optimizer.step()"),
    md("## The next iteration keeps `output` and `loss`\nTheir autograd graph keeps the saved activations alive "
       "until the variables are reassigned or deleted."),
    code("output = model(inputs)\n"
         "loss = torch.nn.functional.cross_entropy(output, targets)"),
    md("## Who holds the memory?\nParameters, gradients, Adam's state, and the graph that `output` and `loss` keep, "
       "each counted once, by variable."),
    code("%gpumem who"),
    md("## The failure\nA shape bug: someone scaled the image width by 1024. The request is far larger than the "
       "machine, a real `DefaultCPUAllocator` (or CUDA) out-of-memory error. Your traceback is shown unchanged; "
       "the panel after it explains what was asked, who holds the memory, and what to change."),
    code("batch_size = 4096\n"
         "images = torch.empty(batch_size, 3, 224, 224 * 1024, device=device)  # width * 1024: the bug",
         metadata={"tags": ["raises-exception"]}),
    md("## Release what costs nothing\n`%gpumem free` drops IPython's last traceback and cached outputs that hold "
       "tensors, then collects garbage and empties the allocator's cache. It shows the plan first and never deletes "
       "a variable of yours."),
    code("%gpumem free"),
    code("%gpumem history"),
]
nb = new_notebook(cells=cells, metadata={"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"},
                                         "language_info": {"name": "python"}})
nbformat.write(nb, "notebooks/oom_walkthrough.ipynb")
