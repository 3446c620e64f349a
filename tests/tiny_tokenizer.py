"""A word-level tokenizer built offline from a few sentences, saved as `transformers` saves one: the local
tokenizer of the data and training tests."""

from pathlib import Path

from tokenizers import Tokenizer, models, pre_tokenizers, trainers

SENTENCES = [
    "the cat sat on the mat",
    "the dog sat on the log",
    "a cat and a dog met on a mat",
    "the log was on the mat and the cat was on the log",
    "every dog has a log and every cat has a mat",
]


def word_tokenizer() -> Tokenizer:
    """A word-level tokenizer trained on SENTENCES, with "[UNK]" (id 0) and "<eos>" (id 1)."""
    tokenizer = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(special_tokens=["[UNK]", "<eos>"])
    tokenizer.train_from_iterator(SENTENCES, trainer=trainer)
    return tokenizer


def save_tokenizer(directory: Path) -> Path:
    """The tokenizer saved in `directory` as `transformers` saves one (tokenizer.json +
    tokenizer_config.json, "<eos>" its end-of-sequence token); returns `directory`."""
    from transformers import PreTrainedTokenizerFast

    PreTrainedTokenizerFast(tokenizer_object=word_tokenizer(), eos_token="<eos>").save_pretrained(directory)
    return directory
