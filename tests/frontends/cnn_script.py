"""A user's MNIST CNN training script, kept in its own file so that the source lines the golden
train-graph dump (golden/cnn_train_simplify.txt) shows do not move when other tests are edited."""
from ember.frontends import compile, nn, optim, spec


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3),
            nn.ReLU(),
            nn.Conv2d(16, 32, 3),
            nn.ReLU(),
        )
        self.classifier = nn.Linear(18432, 10)

    def forward(self, x):
        h = self.features(x)
        h = h.flatten(1)
        return self.classifier(h)


def train_step(dump_dir):
    nn.manual_seed(0)
    model = Net()
    criterion = nn.CrossEntropyLoss()
    return compile(model, criterion, optim.SGD(lr=0.05),
                   example_inputs=(spec((64, 1, 28, 28)), spec((64,), "int64")),
                   device="reference", dump_dir=dump_dir)
