# Sourced by the device scripts that time JPEG files and video streams to boxes (issue 30): the
# trained YOLOv8n FP16 at 640, batch 1..32, with the NMS inside (--nms), at builder effort 1, and
# 512 files cycled from the carried 720p frames.
build_y8nms() {  # build_y8nms SECONDS_ALLOWED
  timeout "$1" python -m sartor build samples/yolo/yolov8n_scenes.onnx -o /tmp/y8nms.plan --device cuda \
    --precision fp16 --min-shapes images:1x3x640x640 --opt-shapes images:32x3x640x640 \
    --max-shapes images:32x3x640x640 --preprocess letterbox=640,mean=0,std=255,rgb,nchw --builder-effort 1 \
    --nms conf=0.25,iou=0.7,max_det=300 > /tmp/build_nms.txt 2>&1
  echo "build --nms exit $? at ${SECONDS}s"
}
make_jpeg512() {  # the files in /tmp/jpeg512
  local frames=(.whl/nvdec/frames/*.jpg)
  mkdir -p /tmp/jpeg512
  for i in $(seq 0 511); do cp "${frames[$(( i % ${#frames[@]} ))]}" "$(printf '/tmp/jpeg512/%03d.jpg' "$i")"; done
}
