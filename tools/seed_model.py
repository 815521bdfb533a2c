"""The seed scenario's model at CPU scale, shared by both notebook generators so they tell one story."""

SEED_MODEL = (
    "model = torch.nn.Sequential(\n"
    "    torch.nn.Linear(2048, 4096), torch.nn.ReLU(),\n"
    "    torch.nn.Linear(4096, 4096), torch.nn.ReLU(),\n"
    "    torch.nn.Linear(4096, 10),\n"
    ").to(device)\n"
    "optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)\n"
    "inputs = torch.randn(512, 2048, device=device)\n"
    "targets = torch.randint(0, 10, (512,), device=device)"
)
