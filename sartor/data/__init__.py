"""The data layer: datasets (COCO, ImageFolder, manifests), image preprocessing, batches.

A bottom layer: it imports only sartor.errors, sartor.progress, numpy and Pillow."""
from .buckets import BucketRefused, Buckets, parse_buckets
from .datasets import (
                       Dataset,
                       Sample,
                       balanced_sample,
                       iterate_batches,
                       load_coco,
                       load_image_folder,
                       load_manifest,
                       load_plain_folder,
                       open_dataset,
)
from .preprocess import (
                       ImageMeta,
                       PreprocessSpec,
                       load_image,
                       parse_preprocess,
                       preprocess_batch,
                       preprocess_image,
)

__all__ = ["BucketRefused", "Buckets", "Dataset", "ImageMeta", "PreprocessSpec", "Sample", "balanced_sample", "iterate_batches", "load_coco",
           "load_image", "load_image_folder", "load_manifest", "load_plain_folder", "open_dataset", "parse_buckets",
           "parse_preprocess", "preprocess_batch", "preprocess_image"]
