"""Data stage: load the raw Amazon-format folder, split it, retrieve candidates, cache parquet."""

from dgr2.data.candidates import CandidateList, SasRecRetriever, build_candidate_list, recall_at_k
from dgr2.data.loader import DataFormatError, LoadReport, RawDataset, load_raw_dataset
from dgr2.data.prepare import PREP_VERSION, PreparedData, prepare_examples
from dgr2.data.seeding import example_rng
from dgr2.data.split import SplitExample, leave_one_out

__all__ = [
    "PREP_VERSION",
    "CandidateList",
    "DataFormatError",
    "LoadReport",
    "PreparedData",
    "RawDataset",
    "SasRecRetriever",
    "SplitExample",
    "build_candidate_list",
    "example_rng",
    "leave_one_out",
    "load_raw_dataset",
    "prepare_examples",
    "recall_at_k",
]
