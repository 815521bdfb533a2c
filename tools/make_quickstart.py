import nbformat
from nbformat.v4 import new_code_cell as code, new_markdown_cell as md, new_notebook
from seed_model import SEED_MODEL

cells = [
    md("# ipy_gpumem quickstart\n\n"
       "What every cell does to memory, without `!nvidia-smi` between the lines. This notebook runs "
       "on a GPU or on the CPU: without CUDA, the same records and views are fed by host memory "
       "(the process's RSS), so everything below works on a laptop too."),
    md("## 1. Load the extension\nFrom now on every cell is recorded. A cell that moves memory by more than "
       "the threshold (16 MiB by default) gets one line under it; the others stay silent."),
    code("%load_ext ipy_gpumem"),
    code("import torch\n"
         "device = 'cuda' if torch.cuda.is_available() else 'cpu'\n"
         "device"),
    md("## 2. Where memory is now\n`%gpumem status` splits each GPU into what PyTorch allocated, what it reserved "
       "but has not allocated, what is used outside PyTorch (the CUDA context, other processes) and what is free. "
       "Before your code touches CUDA, ipy_gpumem says so rather than initializing it for you."),
    code("%gpumem status"),
    md("## 3. The per-cell line\nThe seed question: why does the model's forward pass add memory, backward more, "
       "and Adam's step more again? Build a model and watch each cell."),
    code(SEED_MODEL),
    code("small = [i * i for i in range(1000)]  # moves nothing worth a line: silent"),
    md("## 4. `%%gpumem --lines`: one row per line\nThis replaces `check 1` ... `check 13`: forward keeps activations "
       "for backward, backward adds gradients as large as the weights, and Adam's first step creates two state "
       "buffers per weight. `-o rec` keeps the record."),
    code("%%gpumem --lines -o rec\n"
         "output = model(inputs)\n"
         "loss = torch.nn.functional.cross_entropy(output, targets)\n"
         "optimizer.zero_grad()\n"
         "loss.backward()\n"
         "optimizer.step()"),
    code("# The record is plain data: numbers and strings, ready for your own analysis.\n"
         "step = rec.lines[-1]\n"
         "step.lineno, step.source, (step.devices[0].allocated_delta if step.devices else step.host.rss_delta)"),
    md("Loops are aggregated: a line's deltas are summed over its hits, its peak is the worst single hit."),
    code("%%gpumem --lines\n"
         "for _ in range(3):\n"
         "    output = model(inputs)\n"
         "    loss = torch.nn.functional.cross_entropy(output, targets)\n"
         "    optimizer.zero_grad(set_to_none=True)\n"
         "    loss.backward()\n"
         "    optimizer.step()"),
    md("## 5. Errors are still yours\nA failing cell shows its own traceback, unchanged; the record notes the error "
       "(also when `%%time` swallowed it)."),
    code("%%time\nbad = torch.ones(3) @ torch.ones(4)", metadata={"tags": ["raises-exception"]}),
    md("## 6. The ledger\n`%gpumem history` lists every recorded cell; `ipy_gpumem.history()` returns the records, "
       "`history_frame()` a pandas DataFrame, `%gpumem export` writes JSON or CSV."),
    code("%gpumem history"),
    code("import ipy_gpumem\n"
         "frame = ipy_gpumem.history_frame()\n"
         "frame[['execution_count', 'device', 'delta', 'peak', 'error', 'first_line']].tail()"),
    code("%gpumem export quickstart-cells.json"),
    md("## 7. Configuration\nEvery option is a traitlet: `%config GpuMemMagics` lists them with their help, and "
       "the same names work in `ipython_config.py` as `c.GpuMemMagics.<name>`."),
    code("%config GpuMemMagics.threshold = '1 GiB'\n"
         "big = torch.ones(2**24, device=device)  # 64 MiB: below the new threshold, so silent"),
    code("%config GpuMemMagics.threshold = '16 MiB'\n%config GpuMemMagics"),
    md("`%gpumem off` pauses recording (explicit `%%gpumem` cells still measure), `%gpumem on` resumes, "
       "`%gpumem clear` forgets the history. Bad input gets one line, not a traceback:"),
    code("%gpumem sideways", metadata={"tags": ["raises-exception"]}),
]
nb = new_notebook(cells=cells, metadata={"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"},
                                         "language_info": {"name": "python"}})
nbformat.write(nb, "notebooks/quickstart.ipynb")
